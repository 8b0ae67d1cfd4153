"""The signed image format: build, verify and unpack, and every way an untrusted archive is refused."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from apiary.shared import image
from apiary.shared.image import ImageError


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path / "keys", "test")


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(bytes(range(256)) * 400)  # 100 kB of known bytes
    return path


@pytest.fixture
def built(tmp_path: Path, keys: tuple[Path, Path], model_file: Path) -> image.ImageInfo:
    return image.build_image(tmp_path / "img.tar", model_file, "1.2.0", keys[0], edge_config={"threshold": -1.5},
                             power_profile={"name": "solar-small", "threads": 1}, runtime_version="0.3.36")


def test_keygen_writes_pem_private_and_hex_public(keys: tuple[Path, Path]) -> None:
    priv, pub = keys
    assert priv.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert (priv.stat().st_mode & 0o777) == 0o600
    hex_pub = pub.read_text().strip()
    assert len(hex_pub) == 64 and int(hex_pub, 16) >= 0
    assert image.public_key_hex(priv) == hex_pub
    with pytest.raises(ImageError, match="refusing to overwrite") as e:
        image.write_keypair(priv.parent, "test")
    assert e.value.reason == "key"


def test_keys_load_from_hex_pem_text_and_files(keys: tuple[Path, Path]) -> None:
    from cryptography.hazmat.primitives import serialization

    priv, pub = keys
    pem_pub = image.load_public_key(pub).public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo)
    for form in (pub, str(pub), pub.read_text(), pub.read_bytes(), pem_pub, pem_pub.decode()):
        assert image._public_hex(image.load_public_key(form)) == pub.read_text().strip()
    for bad in ("00" * 31, "not a key", b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----"):
        with pytest.raises(ImageError) as e:
            image.load_public_key(bad)
        assert e.value.reason == "key"
    with pytest.raises(ImageError, match="not an Ed25519 private key"):
        image.load_private_key(pem_pub)  # a public key where the signing key belongs


def test_build_then_verify_and_unpack(tmp_path: Path, built: image.ImageInfo, keys: tuple[Path, Path],
                                      model_file: Path) -> None:
    m = built.manifest
    assert (m.image_version, m.model.filename, m.model.size) == ("1.2.0", "tiny.gguf", model_file.stat().st_size)
    assert m.model.sha256 == image.sha256_file(model_file)
    assert m.runtime.version == "0.3.36" and m.power_profile["threads"] == 1 and m.edge_config == {"threshold": -1.5}
    with tarfile.open(built.path) as tar:
        assert tar.getnames() == ["manifest.json", "manifest.sig", "model/tiny.gguf"]
    v = image.verify_image(built.path, keys[1], expected_sha256=built.sha256, expected_signature=built.signature,
                           expected_version="1.2.0")
    assert v.manifest == m and v.sha256 == built.sha256 and v.size == built.path.stat().st_size
    slot = tmp_path / "slot"
    (slot / "stale").mkdir(parents=True)
    (slot / "old.gguf").write_bytes(b"old")
    image.unpack_image(built.path, slot, keys[1], expected_sha256=built.sha256)
    assert (slot / "tiny.gguf").read_bytes() == model_file.read_bytes()
    assert not (slot / "old.gguf").exists()
    assert image.read_installed(slot, keys[1]) == m


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy an image archive member by member, letting ``edit(name, data)`` change or drop members."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin.getmembers():
            data = tin.extractfile(member).read()
            for name, new in edit(member.name, data):
                info = tarfile.TarInfo(name)
                info.size = len(new)
                tout.addfile(info, io.BytesIO(new))


def _refusal(path: Path, key: Path | str, **expect) -> ImageError:
    with pytest.raises(ImageError) as e:
        image.verify_image(path, key, **expect)
    return e.value


def test_tampered_model_is_refused(tmp_path: Path, built: image.ImageInfo, keys: tuple[Path, Path]) -> None:
    bad = tmp_path / "bad.tar"
    _rewrite(built.path, bad, lambda n, d: [(n, d[:-1] + bytes([d[-1] ^ 1]) if n.startswith("model/") else d)])
    err = _refusal(bad, keys[1])
    assert err.reason == "model_hash"


def test_tampered_manifest_is_refused(tmp_path: Path, built: image.ImageInfo, keys: tuple[Path, Path]) -> None:
    def edit(name: str, data: bytes):
        if name == "manifest.json":
            doc = json.loads(data)
            doc["power_profile"]["threads"] = 8
            data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return [(name, data)]

    bad = tmp_path / "bad.tar"
    _rewrite(built.path, bad, edit)
    assert _refusal(bad, keys[1]).reason == "signature"


def test_wrong_key_wrong_hash_wrong_version_and_signature_swap(tmp_path: Path, built: image.ImageInfo,
                                                               keys: tuple[Path, Path]) -> None:
    _, other_pub = image.write_keypair(tmp_path / "other", "other")
    assert _refusal(built.path, other_pub).reason == "signature"
    assert _refusal(built.path, keys[1], expected_sha256="0" * 64).reason == "hash"
    assert _refusal(built.path, keys[1], expected_version="9.9.9").reason == "version"
    assert _refusal(built.path, keys[1], expected_signature="ab" * 64).reason == "signature"


@pytest.mark.parametrize("case", ["extra member", "missing signature", "traversal name", "duplicate", "garbage",
                                  "symlink", "huge manifest", "not json"])
def test_malformed_archives_are_refused_with_format(tmp_path: Path, built: image.ImageInfo, keys: tuple[Path, Path],
                                                    case: str) -> None:
    bad = tmp_path / "bad.tar"
    if case == "extra member":
        _rewrite(built.path, bad, lambda n, d: [(n, d)] + ([("evil.sh", b"rm -rf /")] if n == "manifest.sig" else []))
    elif case == "missing signature":
        _rewrite(built.path, bad, lambda n, d: [] if n == "manifest.sig" else [(n, d)])
    elif case == "traversal name":
        _rewrite(built.path, bad, lambda n, d: [("../" + n if n.startswith("model/") else n, d)])
    elif case == "duplicate":
        _rewrite(built.path, bad, lambda n, d: [(n, d), (n, d)] if n == "manifest.json" else [(n, d)])
    elif case == "garbage":
        bad.write_bytes(b"\x00garbage" * 100)
    elif case == "symlink":
        with tarfile.open(built.path) as tin, tarfile.open(bad, "w") as tout:
            for m in tin.getmembers():
                tout.addfile(m, tin.extractfile(m))
            link = tarfile.TarInfo("model/link")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tout.addfile(link)
    elif case == "huge manifest":
        _rewrite(built.path, bad, lambda n, d: [(n, d + b" " * image.MAX_MANIFEST_BYTES if n == "manifest.json" else d)])
    elif case == "not json":
        priv = keys[0]

        def edit(name: str, data: bytes):
            if name == "manifest.json":
                return [(name, b"not json")]
            if name == "manifest.sig":
                return [(name, image.load_private_key(priv).sign(b"not json").hex().encode())]
            return [(name, data)]
        _rewrite(built.path, bad, edit)
    err = _refusal(bad, keys[1])
    assert err.reason == "format", err


def test_unpack_refuses_before_writing_anything(tmp_path: Path, built: image.ImageInfo) -> None:
    _, other_pub = image.write_keypair(tmp_path / "other", "other")
    slot = tmp_path / "slot"
    slot.mkdir()
    (slot / "keep.gguf").write_bytes(b"current")
    with pytest.raises(ImageError):
        image.unpack_image(built.path, slot, other_pub)
    assert [p.name for p in slot.iterdir()] == ["keep.gguf"]


def test_read_installed_rejects_incomplete_slots(tmp_path: Path, built: image.ImageInfo,
                                                 keys: tuple[Path, Path]) -> None:
    slot = tmp_path / "slot"
    image.unpack_image(built.path, slot, keys[1])
    (slot / "tiny.gguf").write_bytes(b"short")
    with pytest.raises(ImageError) as e:
        image.read_installed(slot)
    assert e.value.reason == "model_hash"
    with pytest.raises(ImageError) as e:
        image.read_installed(tmp_path / "empty")
    assert e.value.reason == "format"


def test_build_rejects_bad_inputs(tmp_path: Path, keys: tuple[Path, Path], model_file: Path) -> None:
    with pytest.raises(ImageError, match="not found"):
        image.build_image(tmp_path / "x.tar", tmp_path / "missing.gguf", "1.0", keys[0])
    with pytest.raises(ImageError, match="cannot build manifest"):
        image.build_image(tmp_path / "x.tar", model_file, "bad version!", keys[0])
    weird = tmp_path / "we ird.gguf"
    weird.write_bytes(b"x")
    with pytest.raises(ImageError, match="filename"):
        image.build_image(tmp_path / "x.tar", weird, "1.0", keys[0])
    with pytest.raises(ImageError) as e:
        image.build_image(tmp_path / "x.tar", model_file, "1.0", keys[1].read_text() + "zz")
    assert e.value.reason == "key"
    assert not (tmp_path / "x.tar").exists()
