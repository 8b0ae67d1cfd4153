"""Finding frames in a noisy byte stream: boundaries, CRC, resynchronisation.

A serial line or radio gateway delivers bytes, not frames: frames arrive split across
reads, glued together, truncated by a reset, or buried in boot-loader chatter. The
reader hunts for the magic, waits until the whole frame named by the length byte is
there, and accepts it only if the CRC matches. On any failure it steps one byte past
the rejected magic and hunts again, so a real frame hidden inside a bogus candidate is
still found. The reader never raises on input bytes; everything it rejects is counted.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from apiary.firmware_bridge import frames as F
from apiary.firmware_bridge.errors import FrameError

_MAGIC0 = F.MAGIC[0]


@dataclass(slots=True)
class StreamCounters:
    frames_ok: int = 0
    bad_crc: int = 0  # candidates with a matching magic and length whose CRC failed
    resyncs: int = 0  # times the reader lost sync and had to hunt for the next frame
    skipped_bytes: int = 0  # bytes discarded while hunting
    truncated: int = 0  # incomplete candidates abandoned at end of stream / idle line
    malformed: int = 0  # CRC-valid frames whose body does not parse (firmware bug)
    unsupported_version: int = 0  # CRC-valid frames of a version this decoder does not know
    unknown_readings: int = 0  # readings of unknown type skipped inside good frames

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class StreamReader:
    """Feed it bytes in any chunking; it returns every intact frame exactly once, in order."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._in_sync = True
        self.counters = StreamCounters()

    @property
    def pending(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[F.Frame]:
        """Add bytes; return the frames they completed."""
        self._buf += data
        return self._scan(final=False)

    def finish(self) -> list[F.Frame]:
        """No more bytes are coming (end of stream, end of a datagram, or an idle line):
        abandon any incomplete candidate, recover frames hidden behind it, and empty the buffer."""
        return self._scan(final=True)

    def _skip(self, n: int) -> None:
        self.counters.skipped_bytes += n
        if self._in_sync:
            self.counters.resyncs += 1
            self._in_sync = False

    def _scan(self, *, final: bool) -> list[F.Frame]:
        buf, c, out = self._buf, self.counters, []
        pos, n = 0, len(buf)
        while pos < n:
            i = buf.find(F.MAGIC, pos)
            if i < 0:
                # keep a trailing first magic byte: the second may be in the next read
                keep = 1 if not final and buf[n - 1] == _MAGIC0 else 0
                self._skip_if(n - keep - pos)
                pos = n - keep
                break
            self._skip_if(i - pos)
            pos = i
            if n - i < F.HEADER_SIZE:
                if final:
                    c.truncated += 1
                    self._skip(1)
                    pos = i + 1
                    continue
                break
            version, length = buf[i + 2], buf[i + 3]
            if not 1 <= version <= F.MAX_VERSION or length < F.MIN_BODY:
                self._skip(1)  # not a plausible header: noise that happened to contain the magic
                pos = i + 1
                continue
            end = i + F.HEADER_SIZE + length + F.CRC_SIZE
            if end > n:
                if final:
                    c.truncated += 1
                    self._skip(1)
                    pos = i + 1
                    continue
                break
            try:
                F.check_crc(buf, i, length)
            except FrameError:
                c.bad_crc += 1
                self._skip(1)
                pos = i + 1
                continue
            pos = end
            self._in_sync = True
            if version not in F.SUPPORTED_VERSIONS:
                c.unsupported_version += 1
                continue
            try:
                frame = F.parse_body(version, buf, i + F.HEADER_SIZE, i + F.HEADER_SIZE + length)
            except FrameError:
                c.malformed += 1
                continue
            c.frames_ok += 1
            c.unknown_readings += frame.unknown
            out.append(frame)
        del buf[:pos]
        return out

    def _skip_if(self, n: int) -> None:
        if n > 0:
            self._skip(n)
