"""The signed edge image: one tar archive that carries a model and what the device needs to run it.

Layout (an uncompressed tar, members in this order; nothing else is accepted)::

    manifest.json      canonical JSON: image version, model filename + sha256 + size,
                       runtime version, edge config, power profile
    manifest.sig       Ed25519 signature of the exact manifest.json bytes, hex (128 chars)
    model/<filename>   the model file (an INT4 GGUF)

The signature covers the manifest and the manifest pins the model's sha256, so one
signature check plus one hash check authenticate the whole image. The OTA command also
carries the archive's sha256 and the signature, so a device refuses a swapped archive
before it opens it. Everything here reads untrusted bytes; every problem is raised as
:class:`ImageError` (with a short machine-readable ``reason``), never anything else.

Keys: ``keygen`` writes the private key as unencrypted PKCS#8 PEM (mode 0600) and the
public key as 64 hex characters (the raw Ed25519 key, easy to put in a device config).
Both loaders also accept the other form (PEM or raw hex).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from apiary.shared.protocol import OtaCommand, RollbackGrant

IMAGE_FORMAT = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
MODEL_PREFIX = "model/"
MAX_MANIFEST_BYTES = 64 * 1024
_HEX64 = r"^[0-9a-f]{64}$"
_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ImageError(ValueError):
    """An image, key or signature that cannot be trusted or read.

    ``reason`` is one of: ``format`` (not a valid image archive or manifest), ``hash``
    (archive sha256 differs from the expected one), ``signature`` (bad or mismatched
    signature, wrong key), ``model_hash`` (model bytes differ from the manifest),
    ``version`` (manifest version differs from the one announced), ``key`` (unreadable key), ``rollback`` (an
    operator's rollback grant that is missing or does not verify).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ModelEntry(_Strict):
    filename: str = Field(pattern=_FILENAME.pattern)
    sha256: str = Field(pattern=_HEX64)
    size: int = Field(ge=0)


class RuntimeEntry(_Strict):
    name: str = "llama.cpp"
    version: str = Field(min_length=1, max_length=64)


class Manifest(_Strict):
    """What a device needs to know about an image; signed as a whole."""

    format: int = IMAGE_FORMAT
    image_version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")
    created: float
    model: ModelEntry
    runtime: RuntimeEntry
    edge_config: dict[str, Any] = Field(default_factory=dict)
    power_profile: dict[str, Any] = Field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the exact bytes that get signed."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ImageError("format", f"manifest is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != IMAGE_FORMAT:
            raise ImageError("format", f"unsupported manifest format {doc.get('format') if isinstance(doc, dict) else doc!r}")
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ImageError("format", f"invalid manifest: {where}: {first['msg']}") from None


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """A built or verified image: where it is, its manifest, and what an OTA command must carry."""

    path: Path
    manifest: Manifest
    signature: str  # hex
    sha256: str  # of the whole archive
    size: int


# ---------------------------------------------------------------- keys


def generate_keypair() -> tuple[bytes, str]:
    """A fresh Ed25519 key pair: (private key PKCS#8 PEM, public key hex)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem, _public_hex(key.public_key())


def write_keypair(directory: str | Path, name: str = "apiary-image") -> tuple[Path, Path]:
    """Write ``<name>.key`` (PEM, 0600) and ``<name>.pub`` (hex); refuse to overwrite an existing key."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    priv, pub = directory / f"{name}.key", directory / f"{name}.pub"
    if priv.exists() or pub.exists():
        raise ImageError("key", f"refusing to overwrite existing key files in {directory} ({name}.key/.pub)")
    pem, pub_hex = generate_keypair()
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub.write_text(pub_hex + "\n")
    return priv, pub


def _public_hex(public_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def _key_bytes(key: str | bytes | Path) -> bytes:
    """Key material as bytes: a Path or a string that is neither PEM nor hex is read as a file."""
    if isinstance(key, str) and (key.lstrip().startswith("-----") or re.fullmatch(r"\s*[0-9a-fA-F]{64}\s*", key)):
        return key.encode()
    if isinstance(key, (str, Path)):
        try:
            return Path(key).read_bytes()
        except OSError as e:
            raise ImageError("key", f"cannot read key file {key}: {e}") from None
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise ImageError("key", f"a key must be PEM, hex, a file path or an Ed25519 key object, not {type(key).__name__}")


def load_private_key(key: str | bytes | Path) -> Any:
    """An Ed25519 private key from a PEM (bytes, text or file), 64 hex characters (the raw seed) or a key object."""
    return _load_ed25519(key, private=True)


def load_public_key(key: str | bytes | Path) -> Any:
    """An Ed25519 public key from 64 hex characters, a PEM (bytes, text or file) or a key object."""
    return _load_ed25519(key, private=False)


def _load_ed25519(key: str | bytes | Path, private: bool) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    cls: Any = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    kind = "private" if private else "public"
    if isinstance(key, cls):
        return key
    data = _key_bytes(key).strip()
    try:
        if data.startswith(b"-----"):
            loaded = (serialization.load_pem_private_key(data, password=None) if private
                      else serialization.load_pem_public_key(data))
        else:
            raw = bytes.fromhex(data.decode())
            loaded = cls.from_private_bytes(raw) if private else cls.from_public_bytes(raw)
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ImageError("key", f"not an Ed25519 {kind} key: {e}") from None
    if not isinstance(loaded, cls):
        raise ImageError("key", f"not an Ed25519 {kind} key: {type(loaded).__name__}")
    return loaded


def public_key_hex(private_key: str | bytes | Path) -> str:
    return _public_hex(load_private_key(private_key).public_key())


def sign(manifest: Manifest, private_key: str | bytes | Path) -> str:
    return load_private_key(private_key).sign(manifest.to_bytes()).hex()


def verify_signature(manifest_bytes: bytes, signature_hex: str, public_key: str | bytes | Path) -> None:
    """Raise ``ImageError('signature')`` unless ``signature_hex`` signs ``manifest_bytes`` under ``public_key``."""
    from cryptography.exceptions import InvalidSignature

    key = load_public_key(public_key)
    try:
        sig = bytes.fromhex(signature_hex.strip())
    except ValueError:
        raise ImageError("signature", "signature is not hex") from None
    if len(sig) != 64:
        raise ImageError("signature", f"signature must be 64 bytes, got {len(sig)}")
    try:
        key.verify(sig, manifest_bytes)
    except InvalidSignature:
        raise ImageError("signature", "manifest signature does not verify with the trusted public key") from None


# ---------------------------------------------------------------- operator rollback grants


def sign_rollback(cmd: OtaCommand, private_key: str | bytes | Path, *, ttl_s: float, now: float | None = None,
                  nonce: str | None = None) -> OtaCommand:
    """``cmd`` carrying an operator's :class:`RollbackGrant`: valid ``ttl_s`` seconds from ``now``, for this
    command's device and image only, once (a fresh random nonce unless given)."""
    if ttl_s <= 0:
        raise ImageError("rollback", f"a rollback grant needs a positive lifetime, got {ttl_s} s")
    expires = int((time.time() if now is None else now) + ttl_s)
    nonce = nonce or secrets.token_hex(16)
    signature = load_private_key(private_key).sign(cmd.rollback_message(expires, nonce)).hex()
    return cmd.model_copy(update={"rollback": RollbackGrant(expires=expires, nonce=nonce, signature=signature)})


def verify_rollback(cmd: OtaCommand, public_keys: list[Any]) -> str:
    """The hex public key among ``public_keys`` whose signature ``cmd.rollback`` carries; ``ImageError('rollback')``
    when it has none or no key verifies it (signed by another key, or for another device, image or expiry)."""
    from cryptography.exceptions import InvalidSignature

    grant = cmd.rollback
    if grant is None:
        raise ImageError("rollback", "the command carries no rollback grant")
    message, signature = cmd.rollback_message(grant.expires, grant.nonce), bytes.fromhex(grant.signature)
    for key in public_keys:
        loaded = load_public_key(key)
        try:
            loaded.verify(signature, message)
        except InvalidSignature:
            continue
        return _public_hex(loaded)
    raise ImageError("rollback", "the rollback grant's signature does not verify with any operator key this device "
                                 "trusts for this device, image and expiry")


# ---------------------------------------------------------------- build


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_runtime_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "unknown"


def build_image(out: str | Path, model_path: str | Path, image_version: str, private_key: str | bytes | Path, *,
                edge_config: dict[str, Any] | None = None, power_profile: dict[str, Any] | None = None,
                runtime_version: str | None = None) -> ImageInfo:
    """Pack ``model_path`` with a signed manifest into the archive ``out`` (written atomically)."""
    model_path, out = Path(model_path), Path(out)
    if not model_path.is_file():
        raise ImageError("format", f"model file not found: {model_path}")
    if not _FILENAME.match(model_path.name):
        raise ImageError("format", f"model filename {model_path.name!r} must match {_FILENAME.pattern}")
    try:
        manifest = Manifest(
            image_version=image_version, created=time.time(),
            model=ModelEntry(filename=model_path.name, sha256=sha256_file(model_path), size=model_path.stat().st_size),
            runtime=RuntimeEntry(version=runtime_version or default_runtime_version()),
            edge_config=json.loads(json.dumps(edge_config or {})), power_profile=json.loads(json.dumps(power_profile or {})),
        )
    except (ValidationError, TypeError, ValueError) as e:
        raise ImageError("format", f"cannot build manifest: {e}") from None
    signature = sign(manifest, private_key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, MANIFEST_NAME, manifest.to_bytes())
        _add_bytes(tar, SIGNATURE_NAME, signature.encode())
        info = tarfile.TarInfo(MODEL_PREFIX + model_path.name)
        info.size, info.mtime, info.mode = manifest.model.size, int(manifest.created), 0o644
        with open(model_path, "rb") as f:
            tar.addfile(info, f)
    os.replace(tmp, out)
    return ImageInfo(path=out, manifest=manifest, signature=signature, sha256=sha256_file(out), size=out.stat().st_size)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------- verify / unpack


def _open(path: Path) -> tuple[tarfile.TarFile, dict[str, tarfile.TarInfo]]:
    try:
        tar = tarfile.open(path, "r:")
        members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ImageError("format", f"{path.name} is not a readable image archive: {e}") from None
    by_name: dict[str, tarfile.TarInfo] = {}
    for m in members:
        if not m.isfile():
            tar.close()
            raise ImageError("format", f"image member {m.name!r} is not a regular file")
        if m.name in by_name:
            tar.close()
            raise ImageError("format", f"image has duplicate member {m.name!r}")
        by_name[m.name] = m
    return tar, by_name


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    if member.size > limit:
        raise ImageError("format", f"{member.name} is {member.size} bytes, over the {limit}-byte limit")
    f = tar.extractfile(member)
    assert f is not None  # regular file, checked in _open
    return f.read()


def read_manifest(path: str | Path) -> tuple[Manifest, str]:
    """An archive's manifest and signature as it announces them, NOT verified (what a sender needs to address a
    command; devices verify)."""
    tar, members = _open(Path(path))
    with tar:
        if MANIFEST_NAME not in members or SIGNATURE_NAME not in members:
            raise ImageError("format", f"image must contain {MANIFEST_NAME} and {SIGNATURE_NAME}")
        manifest = Manifest.from_bytes(_read_member(tar, members[MANIFEST_NAME], MAX_MANIFEST_BYTES))
        signature = _read_member(tar, members[SIGNATURE_NAME], 1024).decode("ascii", "replace").strip().lower()
    return manifest, signature


def verify_image(path: str | Path, public_key: str | bytes | Path, *, expected_sha256: str | None = None,
                 expected_signature: str | None = None, expected_version: str | None = None) -> ImageInfo:
    """Authenticate an archive without writing anything: archive hash, signature, manifest, model hash."""
    path = Path(path)
    if not path.is_file():
        raise ImageError("format", f"image not found: {path}")
    digest = sha256_file(path)
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ImageError("hash", f"archive sha256 {digest} does not match the expected {expected_sha256}")
    tar, members = _open(path)
    with tar:
        manifest, signature = _check_manifest(tar, members, public_key, expected_signature, expected_version)
        model = members[MODEL_PREFIX + manifest.model.filename]
        f = tar.extractfile(model)
        assert f is not None
        if _stream_sha256(f, None) != manifest.model.sha256:
            raise ImageError("model_hash", f"model {manifest.model.filename} does not match the manifest sha256")
    return ImageInfo(path=path, manifest=manifest, signature=signature, sha256=digest, size=path.stat().st_size)


def _check_manifest(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], public_key: str | bytes | Path,
                    expected_signature: str | None, expected_version: str | None) -> tuple[Manifest, str]:
    if MANIFEST_NAME not in members or SIGNATURE_NAME not in members:
        raise ImageError("format", f"image must contain {MANIFEST_NAME} and {SIGNATURE_NAME}")
    manifest_bytes = _read_member(tar, members[MANIFEST_NAME], MAX_MANIFEST_BYTES)
    try:
        signature = _read_member(tar, members[SIGNATURE_NAME], 1024).decode("ascii").strip().lower()
    except UnicodeDecodeError:
        raise ImageError("signature", "manifest.sig is not hex text") from None
    if expected_signature is not None and signature != expected_signature.strip().lower():
        raise ImageError("signature", "the archive's signature differs from the one in the OTA command")
    verify_signature(manifest_bytes, signature, public_key)  # before the manifest is even parsed
    manifest = Manifest.from_bytes(manifest_bytes)
    if expected_version is not None and manifest.image_version != expected_version:
        raise ImageError("version", f"image is version {manifest.image_version!r}, expected {expected_version!r}")
    expected = {MANIFEST_NAME, SIGNATURE_NAME, MODEL_PREFIX + manifest.model.filename}
    if set(members) != expected:
        extra = sorted(set(members) - expected) or sorted(expected - set(members))
        raise ImageError("format", f"image members do not match the manifest: {extra}")
    if members[MODEL_PREFIX + manifest.model.filename].size != manifest.model.size:
        raise ImageError("model_hash", "model size differs from the manifest")
    return manifest, signature


def _stream_sha256(src: BinaryIO, dst: BinaryIO | None) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: src.read(1 << 20), b""):
        h.update(chunk)
        if dst is not None:
            dst.write(chunk)
    return h.hexdigest()


def unpack_image(path: str | Path, dest: str | Path, public_key: str | bytes | Path, *,
                 expected_sha256: str | None = None, expected_signature: str | None = None,
                 expected_version: str | None = None) -> ImageInfo:
    """Verify the archive (as :func:`verify_image`), then write its three files into ``dest`` durably.

    ``dest`` is emptied first. Files are written under names this function chooses, never
    names taken from the archive, then fsynced; the model's hash is checked again as it is
    written. On any failure ``dest`` is left without a manifest, so it is never mistaken
    for an installed image.
    """
    info = verify_image(path, public_key, expected_sha256=expected_sha256, expected_signature=expected_signature,
                        expected_version=expected_version)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        if old.is_file() or old.is_symlink():
            old.unlink()
    manifest = info.manifest
    tar, members = _open(Path(path))
    with tar:
        src = tar.extractfile(members[MODEL_PREFIX + manifest.model.filename])
        assert src is not None
        with open(dest / manifest.model.filename, "wb") as out:
            digest = _stream_sha256(src, out)
            out.flush()
            os.fsync(out.fileno())
    if digest != manifest.model.sha256:  # the archive changed under us between verify and unpack
        (dest / manifest.model.filename).unlink(missing_ok=True)
        raise ImageError("model_hash", "model changed while unpacking")
    write_durable(dest / SIGNATURE_NAME, info.signature.encode())
    write_durable(dest / MANIFEST_NAME, manifest.to_bytes())  # last: its presence marks a complete slot
    fsync_dir(dest)
    return info


def write_durable(path: Path, data: bytes, *, sync_dir: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically and durably (a temporary file, fsynced, renamed over it); with
    ``sync_dir`` the rename itself is fsynced too, so a power cut leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_installed(slot_dir: str | Path, public_key: str | bytes | Path | None = None) -> Manifest:
    """The manifest of an unpacked slot (signature re-checked when a key is given); ImageError if incomplete."""
    slot_dir = Path(slot_dir)
    try:
        manifest_bytes = (slot_dir / MANIFEST_NAME).read_bytes()
        signature = (slot_dir / SIGNATURE_NAME).read_text().strip()
    except OSError as e:
        raise ImageError("format", f"slot {slot_dir} holds no complete image: {e}") from None
    if public_key is not None:
        verify_signature(manifest_bytes, signature, public_key)
    manifest = Manifest.from_bytes(manifest_bytes)
    model = slot_dir / manifest.model.filename
    if not model.is_file() or model.stat().st_size != manifest.model.size:
        raise ImageError("model_hash", f"slot {slot_dir} is missing its model file or it has the wrong size")
    return manifest
