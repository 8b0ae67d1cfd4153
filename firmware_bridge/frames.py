"""The binary sensor frame a hive monitor's firmware emits, and its encoder and decoder.

Layout (little-endian; full description in docs/frames.md)::

    magic  BE E5 | version u8 | length u8 | device_id u16 | seq u32 | timestamp u32 | readings… | crc16 u16

``length`` counts the bytes from ``device_id`` to the end of the readings; the CRC is
CRC-16/CCITT-FALSE over ``version`` through the last reading byte. Magic, version,
length and the trailing CRC keep this place in every future version, so a reader can
always find frame boundaries and skip a whole frame of a version it does not know.

A reading is a type code followed by its value. The top two bits of the code give the
value's width (1, 2, 4 or 8 bytes), so a decoder skips codes it does not know without a
length byte: that is the forward-compatibility rule. Values are scaled integers (a
microcontroller never formats floats); the type's extreme value means "sensor not
available".

One entry is not a reading: ``0x8A``, the device's **boot counter** (u32, +1 at every boot, kept in
flash). It tells a device that rebooted and counts again from a low sequence number from someone
replaying its old frames. Older decoders skip it like any unknown code, so it needs no new version.
"""
from __future__ import annotations

import binascii
import math
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

from apiary.firmware_bridge.errors import FrameError

MAGIC = b"\xbe\xe5"
VERSION = 1
SUPPORTED_VERSIONS = frozenset({VERSION})
HEADER_SIZE = 4  # magic, version, length
CRC_SIZE = 2
FIXED_BODY = struct.Struct("<HII")  # device_id, seq, timestamp
MIN_BODY = FIXED_BODY.size
MAX_BODY = 255
MAX_FRAME = HEADER_SIZE + MAX_BODY + CRC_SIZE
MAX_VERSION = 15  # a candidate claiming a larger version is noise, not a future frame
_CRC = struct.Struct("<H")
BOOT_CODE = 0x8A  # u32 boot counter: a 4-byte entry in the readings area, not a reading
_BOOT = "\0boot"  # its slot name in a cached layout (no reading can be called that)


def crc16(data: bytes | bytearray | memoryview) -> int:
    """CRC-16/CCITT-FALSE (poly 0x1021, init 0xFFFF): cheap on a microcontroller, in C here."""
    return binascii.crc_hqx(data, 0xFFFF)


def width_of(code: int) -> int:
    """Bytes of value that follow a reading code: 1, 2, 4 or 8, from the code's top two bits."""
    return 1 << (code >> 6)


@dataclass(frozen=True, slots=True)
class ReadingType:
    """One known reading: wire code, event name, integer format and the divisor that makes it a float."""

    code: int
    name: str
    fmt: str  # struct format of the raw integer
    divisor: int
    unit: str

    @property
    def width(self) -> int:
        return width_of(self.code)

    @property
    def sentinel(self) -> int:
        """Raw value meaning "sensor not available": the signed minimum or the unsigned maximum."""
        bits = 8 * self.width
        return -(1 << (bits - 1)) if self.fmt.islower() else (1 << bits) - 1

    @property
    def raw_range(self) -> tuple[int, int]:
        """Raw values a real reading may take (the sentinel excluded)."""
        bits = 8 * self.width
        if self.fmt.islower():
            return -(1 << (bits - 1)) + 1, (1 << (bits - 1)) - 1
        return 0, (1 << bits) - 2


READING_TYPES: tuple[ReadingType, ...] = (
    ReadingType(0x41, "hive_temp_c", "h", 100, "°C"),
    ReadingType(0x42, "hive_humidity_pct", "H", 100, "%RH"),
    ReadingType(0x43, "ambient_temp_c", "h", 100, "°C"),
    ReadingType(0x84, "hive_weight_kg", "i", 1000, "kg"),
    ReadingType(0x45, "acoustic_db", "H", 100, "dB SPL"),
    ReadingType(0x46, "acoustic_freq_hz", "H", 10, "Hz"),
    ReadingType(0x47, "bee_traffic", "H", 1, "flights/5 min"),
    ReadingType(0x48, "battery_v", "H", 1000, "V"),
    ReadingType(0x49, "solar_w", "H", 100, "W"),
)
BY_CODE: dict[int, ReadingType] = {t.code: t for t in READING_TYPES}
BY_NAME: dict[str, ReadingType] = {t.name: t for t in READING_TYPES}
READING_NAMES: tuple[str, ...] = tuple(t.name for t in READING_TYPES)


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame. ``missing`` names readings the device reported as unavailable;
    ``unknown`` counts readings of types this decoder does not know (skipped)."""

    device_id: int
    seq: int
    timestamp: int  # unix seconds from the device clock; 0 = the device has no clock
    readings: dict[str, float]
    missing: tuple[str, ...] = ()
    unknown: int = 0
    version: int = VERSION
    boot: int | None = None  # the device's boot counter, when its firmware sends one


def encode_frame(device_id: int, seq: int, timestamp: int, readings: Mapping[str, float | None], *,
                 extra: Iterable[tuple[int, bytes]] = (), version: int = VERSION, boot: int | None = None) -> bytes:
    """Readings to one frame. ``None`` encodes "sensor not available"; ``extra`` appends raw
    (code, value) readings, e.g. types newer than this encoder, and is validated only for width;
    ``boot`` adds the boot counter entry."""
    if not 0 <= device_id <= 0xFFFF:
        raise FrameError(f"device_id {device_id} does not fit u16")
    if not 0 <= seq <= 0xFFFFFFFF:
        raise FrameError(f"seq {seq} does not fit u32")
    if not 0 <= timestamp <= 0xFFFFFFFF:
        raise FrameError(f"timestamp {timestamp} does not fit u32")
    if not 1 <= version <= MAX_VERSION:
        raise FrameError(f"version {version} outside 1..{MAX_VERSION}")
    parts = [FIXED_BODY.pack(device_id, seq, timestamp)]
    if boot is not None:
        if not 0 <= boot <= 0xFFFFFFFF:
            raise FrameError(f"boot counter {boot} does not fit u32")
        parts.append(struct.pack("<BI", BOOT_CODE, boot))
    for name, value in readings.items():
        t = BY_NAME.get(name)
        if t is None:
            raise FrameError(f"unknown reading {name!r}; known: {', '.join(READING_NAMES)}")
        parts.append(bytes([t.code]) + struct.pack("<" + t.fmt, _to_raw(t, value)))
    for code, value in extra:
        if not 0 <= code <= 0xFF or len(value) != width_of(code):
            raise FrameError(f"extra reading 0x{code:02x} needs a {width_of(code & 0xFF)}-byte value, got {len(value)}")
        parts.append(bytes([code]) + bytes(value))
    body = b"".join(parts)
    if len(body) > MAX_BODY:
        raise FrameError(f"frame body of {len(body)} bytes exceeds {MAX_BODY}")
    covered = bytes([version, len(body)]) + body
    return MAGIC + covered + _CRC.pack(crc16(covered))


def _to_raw(t: ReadingType, value: float | None) -> int:
    if value is None:
        return t.sentinel
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise FrameError(f"{t.name} must be a finite number, got {value!r}")
    raw = round(value * t.divisor)
    lo, hi = t.raw_range
    if not lo <= raw <= hi:
        raise FrameError(f"{t.name}={value} outside the encodable range {lo / t.divisor}..{hi / t.divisor} {t.unit}")
    return raw


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Exactly one frame to a :class:`Frame`, or :class:`FrameError` saying what is wrong."""
    data = bytes(data)
    if len(data) < HEADER_SIZE + MIN_BODY + CRC_SIZE:
        raise FrameError(f"{len(data)} bytes is shorter than the smallest frame")
    if data[:2] != MAGIC:
        raise FrameError(f"bad magic {data[:2].hex()}, want {MAGIC.hex()}")
    length = data[3]
    if len(data) != HEADER_SIZE + length + CRC_SIZE:
        raise FrameError(f"length field says {HEADER_SIZE + length + CRC_SIZE} bytes, got {len(data)}")
    check_crc(data, 0, length)
    return parse_body(data[2], data, HEADER_SIZE, HEADER_SIZE + length)


def check_crc(buf: bytes | bytearray, start: int, length: int) -> None:
    end = start + HEADER_SIZE + length
    want = _CRC.unpack_from(buf, end)[0]
    got = crc16(memoryview(buf)[start + 2:end])
    if want != got:
        raise FrameError(f"bad CRC: frame says {want:04x}, bytes give {got:04x}")


@dataclass(frozen=True, slots=True)
class _Layout:
    """A body layout seen before: one struct for the whole body, and what each reading slot means."""

    struct: struct.Struct
    codes: tuple[int, ...]
    slots: tuple[tuple[str, int, int] | None, ...]  # (name, divisor, sentinel), None for an unknown code;
    # the boot counter's slot is (_BOOT, 1, -1)
    unknown: int


_WIDTH_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}
_layouts: dict[int, _Layout] = {}  # body length -> the last layout of that length (a device repeats its layout)


def parse_body(version: int, buf: bytes | bytearray, start: int, end: int) -> Frame:
    """Decode the body ``buf[start:end]`` of a CRC-checked frame of ``version``."""
    if version not in SUPPORTED_VERSIONS:
        raise FrameError(f"unsupported frame version {version}; supported: {sorted(SUPPORTED_VERSIONS)}")
    if end - start < MIN_BODY:
        raise FrameError(f"body of {end - start} bytes is shorter than {MIN_BODY}")
    lay = _layouts.get(end - start)
    if lay is not None:  # fast path: one unpack, then check the codes really are the cached ones
        values = lay.struct.unpack_from(buf, start)
        if values[3::2] == lay.codes:
            readings: dict[str, float] = {}
            missing: list[str] = []
            boot = None
            for slot, raw in zip(lay.slots, values[4::2]):
                if slot is not None:
                    if slot[0] is _BOOT:
                        boot = raw
                    elif raw == slot[2]:
                        missing.append(slot[0])
                    else:
                        readings[slot[0]] = raw / slot[1]
            return Frame(values[0], values[1], values[2], readings, tuple(missing), lay.unknown, version, boot)
    return _parse_slow(version, buf, start, end)


def _parse_slow(version: int, buf: bytes | bytearray, start: int, end: int) -> Frame:
    device_id, seq, timestamp = FIXED_BODY.unpack_from(buf, start)
    readings: dict[str, float] = {}
    missing: list[str] = []
    unknown = 0
    boot: int | None = None
    fmt, codes, slots = ["<HII"], [], []
    pos = start + MIN_BODY
    while pos < end:
        code = buf[pos]
        width = 1 << (code >> 6)
        if pos + 1 + width > end:
            raise FrameError(f"reading 0x{code:02x} at byte {pos - start} runs past the end of the frame")
        t = BY_CODE.get(code)
        codes.append(code)
        if code == BOOT_CODE:
            if boot is not None:
                raise FrameError("the boot counter appears twice")
            boot = struct.unpack_from("<I", buf, pos + 1)[0]
            fmt.append("BI")
            slots.append((_BOOT, 1, -1))
        elif t is None:
            unknown += 1
            fmt.append("B" + _WIDTH_FMT[width])
            slots.append(None)
        else:
            if t.name in readings or t.name in missing:
                raise FrameError(f"reading {t.name} appears twice")
            raw = struct.unpack_from("<" + t.fmt, buf, pos + 1)[0]
            if raw == t.sentinel:
                missing.append(t.name)
            else:
                readings[t.name] = raw / t.divisor
            fmt.append("B" + t.fmt)
            slots.append((t.name, t.divisor, t.sentinel))
        pos += 1 + width
    if len(_layouts) < 256:
        _layouts[end - start] = _Layout(struct.Struct("".join(fmt)), tuple(codes), tuple(slots), unknown)
    return Frame(device_id, seq, timestamp, readings, tuple(missing), unknown, version, boot)
