"""``python -m apiary``: the CLI, with the checkout off the front of sys.path.

``-m`` puts the working directory first, and run from a checkout its folders (kernels/, shared/, …)
would shadow installed distributions of those names (transformers imports Hugging Face's ``kernels``);
the rooms themselves import as ``apiary.*`` through the installed package.
"""
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT] + [str(_CHECKOUT)]

from apiary.cli import app  # noqa: E402

app()
