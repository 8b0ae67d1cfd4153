"""One id per model, the same everywhere, and the file names a client may send for it.

A model reaches users under three names: its registry name (``smollm2-135m-q4``, what
``apiary models pull`` takes and ``apiary cloud serve`` loads by default), its file name
(``SmolLM2-135M-Instruct.Q4_1.gguf``, the cached file the demo hands ``cloud serve`` as a
path) and that name without ``.gguf``. The id is the registry name whenever the model is a
registry model, given by name or by its file, so ``apiary models list``, ``cloud serve``, the
demo, the README and OpenAI's ``models.list`` say the same thing; the file names stay
accepted as aliases, so a request naming the file is served instead of a 404.
"""
from __future__ import annotations

from pathlib import PurePath

from apiary.shared.assets import REGISTRY

MODEL_SUFFIXES = (".gguf", ".safetensors")


def _stem(filename: str) -> str:
    for suffix in MODEL_SUFFIXES:
        filename = filename.removesuffix(suffix)
    return filename


def registry_name(model: str) -> str | None:
    """The registry model ``model`` stands for: a registry name, or a path to a file named as a registry file."""
    if model in REGISTRY:
        return model
    filename = PurePath(model).name
    return next((asset.name for asset in REGISTRY.values() if asset.filename == filename), None)


def model_id(model: str) -> str:
    """The id ``model`` (a registry name, or a path to a GGUF file or a checkpoint folder) is served under."""
    return registry_name(model) or _stem(PurePath(model).name) or "apiary"


def aliases(model: str) -> frozenset[str]:
    """The other names a request may give for ``model``: its file name, with and without the suffix."""
    name = registry_name(model)
    filename = REGISTRY[name].filename if name else PurePath(model).name
    return frozenset({filename, _stem(filename)}) - {model_id(model), ""}
