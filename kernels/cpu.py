"""What this CPU computes natively, from the ``flags`` line of ``/proc/cpuinfo``.

Why: the machines this runs on differ from day to day (AVX-512 with bf16 and AMX one day, AVX2 +
FMA only the next; docs/benchmarks.md). Where the CPU has no bf16 instructions, oneDNN emulates
bf16 matmuls and they run slower than float32 (decode steps 0.55-0.60 s vs 0.30 s measured on an
AVX2 host), and the prepacked bf16 weights of ``apiary.cloud.engine.linear`` are not available. So the
engine picks its dtype from the flags found here, tests skip what the host cannot do (naming the
missing feature), and every benchmark prints the features. Everything takes the flags as an
argument, so the decisions are testable for any CPU; ``host_flags()`` reads this machine's, less the
flags ``APIARY_CPU_HIDE`` names (``.ci/avx2-rehearsal`` hides AVX-512 and AMX, with torch, oneDNN and
numba held to AVX2 too, so that an AVX2-only host's choices can be rehearsed on a bigger one).
No torch import here: ``apiary.bench.common`` uses this for every benchmark.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterable

# The features that decide speed paths here, in the order they are printed.
RELEVANT = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
            "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# Either one makes bf16 matmuls native (oneDNN's avx512_core_bf16 / avx512_core_amx kernels).
BF16_FEATURES = ("avx512_bf16", "amx_bf16")
CPUINFO = "/proc/cpuinfo"
HIDE_ENV = "APIARY_CPU_HIDE"  # flags to treat as absent: "avx512*,amx*" (a trailing * matches a prefix)


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def parse_model_name(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return "unknown CPU"


@functools.cache
def _cpuinfo() -> str:
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # not Linux: no flags known, so every decision takes its conservative branch
        return ""


def hide(flags: Iterable[str], spec: str) -> frozenset[str]:
    """``flags`` without those ``spec`` names (comma- or space-separated; ``avx512*`` matches a prefix)."""
    names = spec.replace(",", " ").split()
    exact = {n for n in names if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
    return frozenset(f for f in flags if f not in exact and not (prefixes and f.startswith(prefixes)))


def host_flags() -> frozenset[str]:
    """This machine's CPU flags (empty where ``/proc/cpuinfo`` cannot be read), less any ``APIARY_CPU_HIDE``
    names: what every choice of dtype and kernel reads."""
    return hide(parse_flags(_cpuinfo()), os.environ.get(HIDE_ENV, ""))


def host_model_name() -> str:
    return parse_model_name(_cpuinfo())


def relevant(flags: Iterable[str]) -> list[str]:
    """The speed-relevant features present in ``flags``, in ``RELEVANT`` order."""
    present = set(flags)
    return [f for f in RELEVANT if f in present]


def native_bf16(flags: Iterable[str]) -> str | None:
    """The feature that makes bf16 matmuls native on this CPU (``avx512_bf16`` or ``amx_bf16``), or None."""
    present = set(flags)
    return next((f for f in BF16_FEATURES if f in present), None)


def missing_bf16(flags: Iterable[str]) -> str | None:
    """Why bf16 is emulated here (naming the missing features), or None where it is native."""
    if native_bf16(flags):
        return None
    return f"CPU lacks {' and '.join(BF16_FEATURES)} (bf16 matmuls are emulated, slower than float32)"


def describe(flags: Iterable[str] | None = None) -> str:
    """One line for logs and benchmark tables: the relevant features, or a note that none were found."""
    flags = host_flags() if flags is None else flags
    found = relevant(flags)
    return " ".join(found) if found else "no AVX2/AVX-512/AMX flags found"
