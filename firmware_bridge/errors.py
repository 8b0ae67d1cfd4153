"""The one exception type the firmware bridge raises for bad input."""
from __future__ import annotations


class BridgeError(ValueError):
    """Bad input to the bridge or simulator: an unencodable reading, a bad option, an unusable port.

    Subclasses ValueError so callers that already guard against ValueError keep working.
    """


class FrameError(BridgeError):
    """Bytes that are not one valid sensor frame (bad magic, length, CRC, version or reading layout)."""
