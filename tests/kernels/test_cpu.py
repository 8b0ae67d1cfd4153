"""CPU feature detection: decisions from /proc/cpuinfo text, for the hosts these machines have been."""
from __future__ import annotations

from apiary.kernels import cpu

# An AVX2 + FMA host without AVX-512 or bf16 (an AMD EPYC guest, as on 2026-12-01), abridged.
AVX2_HOST = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext lm constant_tsc pni \
pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm sse4a \
fsgsbase bmi1 avx2 smep bmi2 rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero arat umip

processor\t: 1
flags\t\t: fpu avx2
"""
# A Sapphire Rapids guest (this repository's AVX-512 + AMX days), abridged.
AMX_HOST = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl \
avx_vnni avx512_bf16 avx512vbmi avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8
"""


def test_flags_and_model_come_from_the_first_processor() -> None:
    flags = cpu.parse_flags(AVX2_HOST)
    assert {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags
    assert cpu.parse_model_name(AVX2_HOST) == "AMD EPYC 7B13"
    assert cpu.parse_flags("") == frozenset() and cpu.parse_model_name("") == "unknown CPU"
    assert cpu.parse_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}  # Arm's spelling


def test_bfloat16_is_native_only_with_avx512_bf16_or_amx_bf16() -> None:
    avx2, amx = cpu.parse_flags(AVX2_HOST), cpu.parse_flags(AMX_HOST)
    assert cpu.native_bf16(avx2) is None
    reason = cpu.missing_bf16(avx2)
    assert reason is not None and "avx512_bf16" in reason and "amx_bf16" in reason
    assert cpu.native_bf16(amx) == "avx512_bf16" and cpu.missing_bf16(amx) is None
    assert cpu.native_bf16({"amx_bf16", "amx_tile"}) == "amx_bf16"
    assert cpu.native_bf16({"avx512f", "avx512bw"}) is None  # AVX-512 alone emulates bf16


def test_describe_lists_the_relevant_features_in_a_fixed_order() -> None:
    assert cpu.describe(cpu.parse_flags(AVX2_HOST)) == "avx2 fma f16c"
    assert cpu.relevant(cpu.parse_flags(AMX_HOST)) == [
        "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
        "amx_tile", "amx_bf16", "amx_int8"]
    assert cpu.describe(set()) == "no AVX2/AVX-512/AMX flags found"


def test_host_flags_read_this_machine(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(cpu.HIDE_ENV, raising=False)
    with open(cpu.CPUINFO) as f:
        assert cpu.host_flags() == cpu.parse_flags(f.read())


def test_hide_takes_names_and_prefixes() -> None:
    flags = cpu.parse_flags(AMX_HOST)
    kept = cpu.hide(flags, "avx512*, amx*,avx_vnni")
    assert cpu.relevant(kept) == ["avx2", "fma", "f16c"] and cpu.native_bf16(kept) is None
    assert cpu.hide(flags, "") == flags and cpu.hide(flags, "avx512") == flags  # no star: that exact name only
    assert "avx512f" not in cpu.hide(flags, "avx512f") and "avx512bw" in cpu.hide(flags, "avx512f")


def test_host_flags_leave_out_what_apiary_cpu_hide_names(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """How an AVX2-only host's choices are rehearsed on a bigger one (``.ci/avx2-rehearsal``)."""
    monkeypatch.setenv(cpu.HIDE_ENV, "avx512*,amx*")
    assert not any(f.startswith(("avx512", "amx")) for f in cpu.host_flags())
    assert cpu.native_bf16(cpu.host_flags()) is None
