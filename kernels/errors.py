"""The one exception every kernel entry point raises for bad input or an unusable backend."""
from __future__ import annotations


class KernelError(ValueError):
    """Bad shapes, dtypes or devices given to a kernel, or a backend that cannot run here.

    Subclasses ValueError so callers that already guard against ValueError keep working.
    """
