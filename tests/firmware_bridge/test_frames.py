"""The frame codec: golden bytes, round trips for every reading type, forward compatibility, clear errors."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.firmware_bridge import frames as F
from apiary.firmware_bridge.errors import BridgeError, FrameError

FULL = {"hive_temp_c": 34.56, "hive_humidity_pct": 61.2, "ambient_temp_c": -3.25, "hive_weight_kg": 42.125,
        "acoustic_db": 55.5, "acoustic_freq_hz": 247.3, "bee_traffic": 1234, "battery_v": 3.912, "solar_w": 4.75}

# Golden vectors: these bytes are the wire contract with the firmware. Never regenerate them from the encoder.
GOLDEN = [
    (dict(device_id=7, seq=42, timestamp=1718323200, readings=FULL),
     "bee5012707002a00000000886b6641800d42e81743bbfe848da4000045ae1546a90947d20448480f49db01e884"),
    (dict(device_id=1, seq=0, timestamp=0, readings={}), "bee5010a01000000000000000000f4ea"),
    (dict(device_id=65535, seq=0xFFFFFFFF, timestamp=0xFFFFFFFF, readings={"hive_temp_c": None, "battery_v": 3.7},
          extra=[(0x0A, b"\x05"), (0xCB, bytes(range(8)))]),
     "bee5011bffffffffffffffffffff41008048740e0a05cb0001020304050607fa1d"),
    (dict(device_id=1, seq=0, timestamp=0, readings={}, boot=5),  # the boot counter: entry 0x8a, u32
     "bee5010f010000000000000000008a05000000d3d8"),
]


def test_crc_is_ccitt_false():
    assert F.crc16(b"123456789") == 0x29B1  # the published check value of CRC-16/CCITT-FALSE


@pytest.mark.parametrize("kwargs,hexbytes", GOLDEN)
def test_golden_vectors_encode(kwargs, hexbytes):
    assert F.encode_frame(**kwargs).hex() == hexbytes


def test_golden_vector_fields_by_hand():
    data = bytes.fromhex(GOLDEN[0][1])
    assert data[:2] == b"\xbe\xe5" and data[2] == 1 and data[3] == len(data) - 6
    assert struct.unpack_from("<HII", data, 4) == (7, 42, 1718323200)
    assert data[14] == 0x41 and struct.unpack_from("<h", data, 15)[0] == 3456  # hive temp in centi-degrees
    assert data[23] == 0x84 and struct.unpack_from("<i", data, 24)[0] == 42125  # weight in grams, 4 bytes wide
    assert struct.unpack_from("<H", data, len(data) - 2)[0] == F.crc16(data[2:-2])


def test_golden_vectors_decode():
    f = F.decode_frame(bytes.fromhex(GOLDEN[0][1]))
    assert (f.device_id, f.seq, f.timestamp, f.version, f.unknown, f.missing) == (7, 42, 1718323200, 1, 0, ())
    assert f.readings == {k: float(v) for k, v in FULL.items()}
    g = F.decode_frame(bytes.fromhex(GOLDEN[2][1]))
    assert g.readings == {"battery_v": 3.7}
    assert g.missing == ("hive_temp_c",) and g.unknown == 2


@pytest.mark.parametrize("t", F.READING_TYPES, ids=lambda t: t.name)
def test_round_trip_each_reading_type(t):
    lo, hi = t.raw_range
    for raw in (lo, hi, 0 if lo <= 0 else lo, (lo + hi) // 2 + 1):
        value = raw / t.divisor
        f = F.decode_frame(F.encode_frame(3, 9, 100, {t.name: value}))
        assert f.readings == {t.name: value}
    assert F.decode_frame(F.encode_frame(3, 9, 100, {t.name: None})).missing == (t.name,)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF),
       st.dictionaries(st.sampled_from(F.READING_NAMES), st.integers(-(1 << 31), (1 << 32)) | st.none()))
def test_round_trip_property(device_id, seq, timestamp, raws):
    readings = {}
    for name, raw in raws.items():
        t = F.BY_NAME[name]
        lo, hi = t.raw_range
        readings[name] = None if raw is None else min(hi, max(lo, raw)) / t.divisor
    f = F.decode_frame(F.encode_frame(device_id, seq, timestamp, readings))
    assert (f.device_id, f.seq, f.timestamp) == (device_id, seq, timestamp)
    assert f.readings == {k: v for k, v in readings.items() if v is not None}
    assert set(f.missing) == {k for k, v in readings.items() if v is None}


def test_unknown_types_of_every_width_are_skipped():
    extra = [(0x3F, b"\x01"), (0x7E, b"\x01\x02"), (0xBD, b"\x01\x02\x03\x04"), (0xFC, bytes(8))]
    f = F.decode_frame(F.encode_frame(1, 1, 1, {"hive_temp_c": 30.0, "battery_v": 4.0}, extra=extra))
    assert f.readings == {"hive_temp_c": 30.0, "battery_v": 4.0}
    assert f.unknown == 4


def test_boot_counter_is_read_by_new_decoders_and_skipped_by_old_ones():
    data = F.encode_frame(9, 3, 7, {"battery_v": 3.9}, boot=0xFFFFFFFF)
    for _ in range(2):  # the second decode takes the cached-layout path
        f = F.decode_frame(data)
        assert (f.boot, f.readings, f.unknown, f.missing) == (0xFFFFFFFF, {"battery_v": 3.9}, 0, ())
    assert F.decode_frame(F.encode_frame(9, 3, 7, {"battery_v": 3.9})).boot is None
    # a decoder from before the counter skips it as an unknown 4-byte entry (the code's top bits say 4 bytes)
    assert F.BOOT_CODE not in F.BY_CODE and F.width_of(F.BOOT_CODE) == 4
    with pytest.raises(FrameError, match="boot counter appears twice"):
        F.decode_frame(F.encode_frame(9, 3, 7, {}, boot=1, extra=[(F.BOOT_CODE, bytes(4))]))
    with pytest.raises(FrameError, match="boot counter"):
        F.encode_frame(9, 3, 7, {}, boot=1 << 32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(device_id=70000, seq=0, timestamp=0, readings={}), "u16"),
    (dict(device_id=1, seq=-1, timestamp=0, readings={}), "u32"),
    (dict(device_id=1, seq=0, timestamp=1 << 32, readings={}), "u32"),
    (dict(device_id=1, seq=0, timestamp=0, readings={"nectar": 1.0}), "unknown reading"),
    (dict(device_id=1, seq=0, timestamp=0, readings={"hive_temp_c": 400.0}), "outside the encodable range"),
    (dict(device_id=1, seq=0, timestamp=0, readings={"bee_traffic": -1}), "outside the encodable range"),
    (dict(device_id=1, seq=0, timestamp=0, readings={"battery_v": float("nan")}), "finite"),
    (dict(device_id=1, seq=0, timestamp=0, readings={"battery_v": "3.7"}), "finite"),
    (dict(device_id=1, seq=0, timestamp=0, readings={}, extra=[(0x41, b"\x00")]), "2-byte value"),
    (dict(device_id=1, seq=0, timestamp=0, readings={}, extra=[(0xC1, bytes(8))] * 30), "exceeds"),
])
def test_encoder_rejects_bad_input(kwargs, match):
    with pytest.raises(FrameError, match=match):
        F.encode_frame(**kwargs)


def _reframe(body: bytes, version: int = 1) -> bytes:
    covered = bytes([version, len(body)]) + body
    return F.MAGIC + covered + struct.pack("<H", F.crc16(covered))


@pytest.mark.parametrize("data,match", [
    (b"", "shorter"),
    (b"\x00" * 16, "magic"),
    (bytes.fromhex(GOLDEN[0][1])[:-1], "length field"),
    (bytes.fromhex(GOLDEN[1][1])[:-2] + b"\x00\x00", "CRC"),
    (_reframe(bytes(10), version=2), "unsupported frame version 2"),
    (_reframe(bytes(10) + b"\x41\x01"), "runs past the end"),
    (_reframe(bytes(10) + b"\x47\x01\x00\x47\x02\x00"), "appears twice"),
], ids=["empty", "no-magic", "short", "bad-crc", "version-2", "overrun", "twice"])
def test_decoder_rejects_bad_frames_with_one_error_type(data, match):
    with pytest.raises(FrameError, match=match):
        F.decode_frame(data)


def test_frame_error_is_the_rooms_error_and_a_value_error():
    assert issubclass(FrameError, BridgeError) and issubclass(BridgeError, ValueError)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decode_frame_never_crashes_on_random_bytes(data):
    try:
        F.decode_frame(data)
    except FrameError:
        pass
