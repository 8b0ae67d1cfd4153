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


def test_host_flags_read_this_machine() -> None:
    with open(cpu.CPUINFO) as f:
        assert cpu.host_flags() == cpu.parse_flags(f.read())
