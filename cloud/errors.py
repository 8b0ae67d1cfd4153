"""The one exception type the cloud service raises for bad configuration or bad operator input.

HTTP handlers never let it escape: the API maps request problems to 4xx responses.
Anything a caller of the Python API (``CloudService``, ``KeyRing``, ``SqliteStore``,
the CLI) does wrong surfaces as :class:`CloudError` with a message that says what to fix.
"""
from __future__ import annotations


class CloudError(ValueError):
    """Bad cloud configuration, key file, database path or operator input."""
