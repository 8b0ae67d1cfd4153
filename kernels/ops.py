"""The one kernel interface the engine calls: checks inputs, then dispatches to Triton or torch.

``auto`` (the default) runs the Triton kernels on CUDA tensors and the torch references
(``apiary.kernels.reference``) everywhere else, except decode attention on CPU, which the numba
kernel (``apiary.kernels.cpu_attention``) serves for float32, bfloat16 and int8 caches (``decode_backend``),
per-row int8 quantization of CPU batches (``quantize_rows``, ``apiary.kernels.cpu_quant``), bf16
projections where numba compiles ``vdpbf16ps`` (``bind_bf16_linear``, ``apiary.kernels.cpu_bf16_gemm``), float32
projections from bf16 weights (``bind_bf16w_linear``, ``apiary.kernels.cpu_bf16w_gemm``), and
RMSNorm, rotary and the float KV write of CPU float32/bfloat16 tensors (``apiary.kernels.cpu_layers``).
``cpu_step`` hands a CPU forward pass those kernels checked once for all its layers
(``apiary.kernels.cpu_layers.CpuStep``): at decode sizes the per-call checks and views cost ten times the
kernels.
``set_backend("torch"|"triton")`` or the env var ``APIARY_KERNELS=torch|triton`` forces one; forcing Triton on CPU tensors works only under the
Triton interpreter (``TRITON_INTERPRET=1``), which is how the kernels are tested without a GPU.
int8 KV caches (per-token, per-KV-head float32 scales beside them: ``k_scale``/``v_scale``
``[num_blocks, block_size, num_kv_heads]``) are a CPU format: the numba kernels and the torch
references read and write them; the Triton kernels do not, and such calls are refused.
Every bad input raises ``apiary.kernels.errors.KernelError``. Checks look at shapes, dtypes and
devices only, never at tensor values, so they cost no device synchronisation.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from apiary.kernels import reference
from apiary.kernels.errors import KernelError

if TYPE_CHECKING:
    from apiary.kernels.cpu_int8_gemm import GroupedWeight
    from apiary.kernels.cpu_bf16_gemm import Bound as BoundBF16, PackedBF16
    from apiary.kernels.cpu_bf16w_gemm import Bound as BoundBF16W, HeldBF16
    from apiary.kernels.cpu_decode_layers import LayerStack, StackWeight
    from apiary.kernels.cpu_layers import CpuStep

BACKENDS = ("auto", "torch", "triton")
DECODE_BACKENDS = ("auto", "torch", "triton", "numba")  # paged_decode_attention's per-call ``backend``
NUMBA_DTYPES = (torch.float32, torch.bfloat16)  # the activations apiary.kernels.cpu_quant serves
NUMBA_CACHE_DTYPES = (*NUMBA_DTYPES, torch.int8)  # the caches apiary.kernels.cpu_attention serves
NUMBA_QUANT_MIN_ROWS = 8  # below this numba's call overhead (~20 us) outweighs its single pass (measured)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_backend: str | None = None  # None: follow $APIARY_KERNELS


def set_backend(name: str) -> None:
    """Force ``"torch"`` or ``"triton"``, or go back to ``"auto"`` selection by device."""
    global _backend
    if name not in BACKENDS:
        raise KernelError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    _backend = name


def get_backend() -> str:
    """The configured backend: ``set_backend``'s choice, else ``$APIARY_KERNELS``, else ``"auto"``."""
    name = _backend if _backend is not None else os.environ.get("APIARY_KERNELS", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise KernelError(f"APIARY_KERNELS={name!r} is not one of {BACKENDS}")
    return name


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package is installed (it is optional on CPU-only machines)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes"}


def resolve_backend(device: torch.device) -> str:
    """Which implementation serves tensors on ``device``: ``"torch"`` or ``"triton"``."""
    name = get_backend()
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() and not interpreting() else "torch"
    return resolve_backend_named(name, device)


@functools.cache
def numba_available() -> bool:
    """True when ``numba`` is installed (the cloud extra brings it; the CPU decode kernel needs it)."""
    return importlib.util.find_spec("numba") is not None


def decode_backend(device: torch.device, dtype: torch.dtype, backend: str | None = None) -> str:
    """Which implementation serves ``paged_decode_attention`` for caches of ``dtype`` on ``device``:
    ``"triton"``, ``"numba"`` or ``"torch"``. ``backend`` (one of ``DECODE_BACKENDS``) overrides the
    configured backend for this choice; ``"numba"`` outside its CPU dtypes raises ``KernelError``."""
    name = get_backend() if backend is None else backend
    if name not in DECODE_BACKENDS:
        raise KernelError(f"unknown decode attention backend {name!r}; choose one of {DECODE_BACKENDS}")
    numba_fits = device.type == "cpu" and dtype in NUMBA_CACHE_DTYPES and numba_available()
    if name == "numba":
        if not numba_fits:
            raise KernelError(f"the numba decode kernel serves CPU caches of {NUMBA_CACHE_DTYPES} with numba installed, "
                              f"not {dtype} on {device.type}")
        return "numba"
    if name == "auto" and numba_fits:
        return "numba"
    return resolve_backend(device) if name == "auto" else resolve_backend_named(name, device)


def resolve_backend_named(name: str, device: torch.device) -> str:
    """``resolve_backend`` for an explicitly named backend (``"torch"`` or ``"triton"``)."""
    if name == "torch":
        return "torch"
    if not triton_available():
        raise KernelError("kernel backend 'triton' was forced but triton is not installed")
    if device.type != "cuda" and not interpreting():
        raise KernelError(f"Triton kernels need CUDA tensors (got {device.type}); "
                          "on CPU they run only in the interpreter: set TRITON_INTERPRET=1")
    return "triton"


def _triton(module: str, device: torch.device) -> ModuleType:
    """Import a Triton kernel module; CPU tensors need it to have been imported in interpreter mode."""
    loaded = importlib.import_module(f"apiary.kernels.{module}")
    if device.type != "cuda" and not importlib.import_module("apiary.kernels.triton_support").INTERPRETED:
        raise KernelError("the Triton kernels were imported compiled (TRITON_INTERPRET unset at import), so they "
                          "cannot run on CPU tensors; set TRITON_INTERPRET=1 before the first kernel call")
    return loaded


# ---------------------------------------------------------------- input checks


def _check(cond: bool, message: Callable[[], str]) -> None:
    """Raise ``KernelError(message())`` unless ``cond``: the message is built only for a failure (formatting
    shapes on every call cost more than the numba kernels it guards)."""
    if not cond:
        raise KernelError(message())


def _check_tensor(name: str, t: object, dims: int | None = None, float_: bool = False, int_: bool = False) -> None:
    _check(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if dims is not None:
        _check(t.dim() == dims, lambda: f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if float_:
        _check(t.dtype in FLOAT_DTYPES, lambda: f"{name} must be float32/float16/bfloat16, got {t.dtype}")
    if int_:
        _check(not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool,
               lambda: f"{name} must be an integer tensor, got {t.dtype}")


def _check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    _check(all(d == first for d in devices.values()), lambda: f"tensors are on different devices: {devices}")
    return first


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> bool:
    """Checks a cache pair (and an int8 pair's scales); True if the caches are int8."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, 4)
        _check(cache.dtype in FLOAT_DTYPES or cache.dtype == torch.int8,
               lambda: f"{name} must be float32/float16/bfloat16 or int8, got {cache.dtype}")
    _check(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
           lambda: f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
                   f"{v_cache.dtype} differ")
    _check(k_cache.is_contiguous() and v_cache.is_contiguous(),
           lambda: "k_cache/v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")
    quantized = k_cache.dtype == torch.int8
    if not quantized:
        _check(k_scale is None and v_scale is None,
               lambda: f"k_scale/v_scale go with int8 caches, not {k_cache.dtype} ones")
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(isinstance(s, torch.Tensor),
               lambda: f"int8 caches need {name} (float32 [num_blocks, block_size, num_kv_heads])")
        assert isinstance(s, torch.Tensor)
        _check(s.dtype == torch.float32 and tuple(s.shape) == tuple(k_cache.shape[:3]) and s.is_contiguous(),
               lambda: f"{name} must be contiguous float32 {tuple(k_cache.shape[:3])}, got {tuple(s.shape)} {s.dtype}")
        _check(s.device == k_cache.device, lambda: f"{name} is on {s.device}, the caches on {k_cache.device}")
    _check(resolve_backend(k_cache.device) == "torch",
           lambda: "int8 KV caches are read by the CPU kernels (numba, torch references), not by the Triton kernels: "
           "use a float cache on CUDA")
    return True


def reads_cache(query: torch.dtype, cache: torch.dtype) -> bool:
    """Whether queries of dtype ``query`` may attend over a cache of ``cache`` rows: its own dtype, int8 (with scales),
    or float32 queries over bf16 rows (``EngineConfig(kv_cache_dtype="bf16")``: the kernels widen each row, exactly)."""
    return cache in (query, torch.int8) or (query == torch.float32 and cache == torch.bfloat16)


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     batch: int, scale: float, sliding_window: int | None) -> None:
    _check_tensor("q", q, 3, float_=True)
    _check(reads_cache(q.dtype, k_cache.dtype), lambda: f"q is {q.dtype} but the cache is {k_cache.dtype}")
    _check(q.shape[2] == k_cache.shape[3], lambda: f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    _check(q.shape[1] % k_cache.shape[2] == 0,
           lambda: f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})")
    _check_tensor("block_tables", block_tables, 2, int_=True)
    _check_tensor("context_lens", context_lens, 1, int_=True)
    _check(block_tables.shape[0] == batch,
           lambda: f"block_tables has {block_tables.shape[0]} rows for {batch} sequences")
    _check(context_lens.shape[0] == batch,
           lambda: f"context_lens has {context_lens.shape[0]} entries for {batch} sequences")
    _check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
           lambda: f"scale must be a positive float, got {scale!r}")
    _check(sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
                                      and sliding_window >= 1),
           lambda: f"sliding_window must be None or a positive int, got {sliding_window!r}")


# ---------------------------------------------------------------- the interface


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping[T]``; slots < 0 are skipped.

    Into int8 caches each token's row per KV head is quantized, its scale written to ``k_scale``/``v_scale``."""
    _check_tensor("key", key, 3, float_=True)
    _check_tensor("value", value, 3, float_=True)
    quantized = _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_tensor("slot_mapping", slot_mapping, 1, int_=True)
    _check(key.shape == value.shape, lambda: f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    _check(tuple(key.shape[1:]) == tuple(k_cache.shape[2:]),
           lambda: f"key is [T, {key.shape[1]}, {key.shape[2]}] but the cache holds "
           f"[..., {k_cache.shape[2]}, {k_cache.shape[3]}]")
    _check(slot_mapping.shape[0] == key.shape[0],
           lambda: f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    device = _check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if key.shape[0] == 0:
        return
    if quantized and _numba_serves(key):
        from apiary.kernels import cpu_quant  # imports numba: only once an int8 cache is written

        cpu_quant.write_kv_int8(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    elif quantized:
        reference.write_kv_int8(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    elif resolve_backend(device) == "triton":
        _triton("kv_cache", device).write_kv(key, value, k_cache, v_cache, slot_mapping)
    elif _cpu_layers_serve(key, value, k_cache, v_cache):
        _cpu_layers().write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           backend: str | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, ``q[B, Hq, D]``, over its ``context_lens[b]`` cached tokens -> ``[B, Hq, D]``.

    ``backend``: this call's choice (``decode_backend``); None follows ``set_backend`` / ``$APIARY_KERNELS``.
    The numba and Triton kernels read ragged lengths as they are; the torch reference pads every
    sequence to the longest (callers group similar lengths for it). int8 caches need their scales."""
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_attention(q, k_cache, block_tables, context_lens, q.shape[0] if isinstance(q, torch.Tensor) else -1,
                     scale, sliding_window)
    device = _check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                                context_lens=context_lens)
    chosen = decode_backend(device, k_cache.dtype, backend)
    if chosen == "numba":
        from apiary.kernels import cpu_attention  # imports numba: only once a CPU decode runs

        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                                                    sliding_window, k_scale, v_scale)
    if chosen == "triton":
        _check(q.dtype == k_cache.dtype, lambda: f"the Triton kernels read caches of the queries' dtype, not "
                                                 f"{k_cache.dtype} under {q.dtype}")
        kernel = _triton("paged_attention", device)
        return kernel.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                                             sliding_window)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                                            sliding_window, k_scale, v_scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention of variable-length new tokens ``q[T, Hq, D]`` over their cached prefix -> ``[T, Hq, D]``.

    The new tokens' K/V must already be in the cache. Query i of sequence b sits at position
    ``context_lens[b] - q_len_b + i`` with ``q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]``.
    int8 caches need their scales. Where ``decode_backend`` picks numba (``backend`` as there) and the head dim
    is a multiple of ``cpu_attention.LANES``, the numba kernels serve every run: verifications (at most
    ``cpu_attention.SHORT_QUERIES`` queries) one item per sequence, prompt chunks in items of 16 query rows
    that skip the keys their queries cannot see (2.2x SDPA on 128-512-token prompts). Elsewhere the reference
    (gather + SDPA).
    """
    quantized = _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, int_=True)
    _check(cu_seqlens_q.shape[0] >= 1, lambda: "cu_seqlens_q needs at least one entry (B + 1 offsets)")
    _check_attention(q, k_cache, block_tables, context_lens, cu_seqlens_q.shape[0] - 1, scale, sliding_window)
    device = _check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                                cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    if not quantized and resolve_backend(device) == "triton":
        _check(q.dtype == k_cache.dtype, lambda: f"the Triton kernels read caches of the queries' dtype, not "
                                                 f"{k_cache.dtype} under {q.dtype}")
        kernel = _triton("paged_attention", device)
        return kernel.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                              float(scale), sliding_window)
    if decode_backend(device, k_cache.dtype, backend) == "numba":
        out = _prefill_on_numba(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, float(scale),
                                sliding_window, k_scale, v_scale)
        if out is not None:
            return out
    dequantize = None
    if quantized and _numba_serves(q):
        from apiary.kernels import cpu_quant  # imports numba: only once an int8 cache is read

        dequantize = cpu_quant.gather_dequantize  # int8 rows into the gather buffer in one pass, same values
    return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                             float(scale), sliding_window, k_scale, v_scale, dequantize)


def _prefill_on_numba(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      sliding_window: int | None, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None) -> torch.Tensor | None:
    """``paged_prefill_attention`` from the numba kernels; None when the head dim does not fill their lanes."""
    from apiary.kernels import cpu_attention  # imports numba: only once a CPU attention runs

    if q.shape[-1] % cpu_attention.LANES:
        return None
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    _check(bool((context_lens.long() >= q_lens).all()),
           lambda: "context_lens must count each sequence's new tokens (context_lens >= query lengths)")
    return cpu_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                 torch.nonzero(q_lens > 0).flatten(), scale, sliding_window,
                                                 k_scale, v_scale).to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x[T, H]``; with ``residual`` returns ``(rmsnorm(x + residual), x + residual)``."""
    _check_tensor("x", x, float_=True)
    _check_tensor("weight", weight, 1, float_=True)
    _check(x.dim() >= 1 and x.shape[-1] == weight.shape[0],
           lambda: f"x's last dim {tuple(x.shape)[-1:]} must match weight {tuple(weight.shape)}")
    _check(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0,
           lambda: f"eps must be >= 0, got {eps!r}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        _check_tensor("residual", residual, float_=True)
        _check(residual.shape == x.shape, lambda: f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        tensors["residual"] = residual
    device = _check_same_device(**tensors)
    if resolve_backend(device) == "triton" and x.numel() > 0:
        return _triton("rms_norm", device).rms_norm(x, weight, float(eps), residual)
    if (x.dim() == 2 and _cpu_layers_serve(x, *(() if residual is None else (residual,)))
            and weight.dtype in (torch.float32, x.dtype) and weight.is_contiguous()):
        return _cpu_layers().rms_norm(x, weight, float(eps), residual)
    return reference.rms_norm(x, weight, float(eps), residual)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of ``q[T, Hq, D]`` and ``k[T, Hkv, D]`` at ``positions[T]``; returns new ``(q, k)``."""
    _check_tensor("q", q, 3, float_=True)
    _check_tensor("k", k, 3, float_=True)
    _check_tensor("positions", positions, 1, int_=True)
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, float_=True)
    _check(q.shape[0] == k.shape[0] == positions.shape[0],
           lambda: f"q, k and positions disagree on the token count: {q.shape[0]}, {k.shape[0]}, {positions.shape[0]}")
    _check(q.shape[2] == k.shape[2] == cos_sin_cache.shape[1],
           lambda: f"head_dim of q ({q.shape[2]}), k ({k.shape[2]}) and cos_sin_cache ({cos_sin_cache.shape[1]}) "
                   "differ")
    _check(q.shape[2] % 2 == 0, lambda: f"head_dim must be even for rotary, got {q.shape[2]}")
    device = _check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    if resolve_backend(device) == "triton" and q.shape[0] > 0:
        return _triton("rotary", device).apply_rotary(q, k, positions, cos_sin_cache)
    if _cpu_layers_serve(q, k) and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous():
        return _cpu_layers().apply_rotary(q, k, positions, cos_sin_cache)
    return reference.apply_rotary(q, k, positions, cos_sin_cache)


def cpu_step(tokens: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             eps: float, positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, num_decode_tokens: int, decode_block_tables: torch.Tensor,
             decode_context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
             decode_backend_name: str | None = None, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, prefill_block_tables: torch.Tensor | None = None,
             prefill_cu_seqlens_q: torch.Tensor | None = None,
             prefill_context_lens: torch.Tensor | None = None) -> CpuStep | None:
    """A CPU forward pass's per-layer kernels checked once (``apiary.kernels.cpu_layers.CpuStep``), or None where
    they do not serve: not the ``auto`` backend, no numba, a non-CPU device, a dtype other than float32/bfloat16,
    or decode attention other than numba's (``decode_backend_name``, see ``decode_backend``). Caches hold
    ``dtype`` rows, bf16 ones under float32 rows, or int8 ones with their ``k_scale``/``v_scale``.

    ``k_cache``/``v_cache``: one layer's caches; the caller guarantees every layer's are alike, and that the
    tensors it hands the step's methods have ``tokens`` rows of ``dtype`` in the layout checked here.
    ``prefill_*``: the query runs after the decode rows (``paged_prefill_attention``'s arguments); where the
    numba kernels serve them, ``CpuStep.attention`` takes every row of the step.
    """
    if not (get_backend() == "auto" and numba_available() and dtype in NUMBA_DTYPES):
        return None
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("k_cache", k_cache),
                    ("v_cache", v_cache), ("cos_sin_cache", cos_sin_cache)):
        _check_tensor(name, t)
        if t.device.type != "cpu":
            return None
    if (not reads_cache(dtype, k_cache.dtype)
            or decode_backend(k_cache.device, k_cache.dtype, decode_backend_name) != "numba"):
        return None
    quantized = _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check(tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim) and num_heads % num_kv_heads == 0,
           lambda: f"the caches hold [..., {k_cache.shape[2]}, {k_cache.shape[3]}], not {num_kv_heads} KV heads of "
                   f"{head_dim} for {num_heads} query heads")
    _check(positions.dim() == 1 and slot_mapping.dim() == 1 and positions.shape[0] == slot_mapping.shape[0] == tokens,
           lambda: f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} need {tokens} "
                   "entries")
    _check(cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous() and cos_sin_cache.dim() == 2
           and cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0,
           lambda: f"cos_sin_cache must be contiguous float32 [P, {head_dim}], got {tuple(cos_sin_cache.shape)} "
                   f"{cos_sin_cache.dtype}")
    _check(isinstance(eps, (int, float)) and eps >= 0, lambda: f"eps must be >= 0, got {eps!r}")
    decode = None
    if num_decode_tokens:  # a stand-in query of the decode rows' shape: the checks read shapes and dtypes only
        _check_attention(torch.empty(num_decode_tokens, num_heads, head_dim, dtype=dtype), k_cache,
                         decode_block_tables, decode_context_lens, num_decode_tokens, scale, sliding_window)
        decode = (decode_block_tables, decode_context_lens, float(scale), sliding_window)
    prefill = None
    if prefill_cu_seqlens_q is not None and tokens > num_decode_tokens:
        from apiary.kernels import cpu_attention  # imports numba: only once a CPU attention runs

        _check_tensor("cu_seqlens_q", prefill_cu_seqlens_q, 1, int_=True)
        runs = prefill_cu_seqlens_q.shape[0] - 1
        _check_attention(torch.empty(tokens - num_decode_tokens, num_heads, head_dim, dtype=dtype), k_cache,
                         prefill_block_tables, prefill_context_lens, runs, scale, sliding_window)
        cu = prefill_cu_seqlens_q.long()
        _check(runs >= 1 and int(cu[0]) == 0 and int(cu[-1]) == tokens - num_decode_tokens
               and bool((cu[1:] >= cu[:-1]).all()) and bool((prefill_context_lens.long() >= cu[1:] - cu[:-1]).all()),
               lambda: f"prefill_cu_seqlens_q must rise from 0 to the {tokens - num_decode_tokens} query-run rows, "
                       "and context_lens count each run's new tokens")
        if head_dim % cpu_attention.LANES == 0:
            prefill = (prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, float(scale), sliding_window)
    return _cpu_layers().CpuStep(tokens, hidden, num_heads, num_kv_heads, head_dim, dtype, float(eps), positions,
                                 slot_mapping, cos_sin_cache, decode, quantized, prefill)


def _cpu_layers_serve(*tensors: torch.Tensor) -> bool:
    """``apiary.kernels.cpu_layers`` takes these (``auto`` backend, numba installed, and its ``serves``)."""
    return get_backend() == "auto" and numba_available() and _cpu_layers().serves(*tensors)


def _cpu_layers() -> ModuleType:
    from apiary.kernels import cpu_layers  # imports numba: only once a CPU step runs

    return cpu_layers


def _numba_serves(x: torch.Tensor) -> bool:
    """The numba quantizer takes ``x`` (``auto`` backend, a CPU float32/bfloat16 tensor, numba installed)."""
    return get_backend() == "auto" and x.device.type == "cpu" and x.dtype in NUMBA_DTYPES and numba_available()


def _cpu_int8_gemm() -> ModuleType:
    from apiary.kernels import cpu_int8_gemm  # imports numba: only once int8 weights are asked for

    return cpu_int8_gemm


def grouped_int8_available() -> bool:
    """The grouped int8 GEMM (``apiary.kernels.cpu_int8_gemm``) runs here: numba is installed and compiles
    for a CPU with AVX-512 VNNI or AVX2."""
    return numba_available() and _cpu_int8_gemm().available()


def grouped_int8_kernel() -> str | None:
    """Which of the grouped int8 GEMM's kernels runs here (``"avx512_vnni"``, ``"avx2"``), or None."""
    return _cpu_int8_gemm().isa() if numba_available() else None


def pack_grouped_int8(weight: torch.Tensor) -> GroupedWeight:
    """``weight [N, K]`` as int8 with one scale per (output, 64 inputs), in the grouped kernel's layout."""
    _check_tensor("weight", weight, 2, float_=True)
    return _cpu_int8_gemm().quantize_weight(weight)


def grouped_int8_linear(x: torch.Tensor, weight: GroupedWeight, gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T`` through the grouped int8 GEMM, ``x`` quantized per 64 inputs inside the call;
    ``gated``: ``x = [gate | up]`` and the input is ``silu(gate) * up``."""
    return _cpu_int8_gemm().linear(x, weight, gated)


def bind_grouped_int8(weight: GroupedWeight) -> Callable[..., torch.Tensor]:
    """``grouped_int8_linear`` for this one weight, called as ``f(x, gated=False)``: the kernel chosen once,
    for a layer that calls it every step."""
    return _cpu_int8_gemm().Bound(weight)


def layer_stackable(weights: dict[str, object], biases: dict[str, object]) -> str | None:
    """Why a decoder layer's projections (``qkv``, ``o_proj``, ``gate_up``, ``down`` -> weight, -> bias) cannot
    join a run of layers at decode (``apiary.kernels.cpu_decode_layers``), or None. Weights: grouped int8
    (``pack_grouped_int8``) or the bf16 kernel's (``bind_bf16_linear(...).weight``), all of one kind."""
    if not numba_available():
        return "numba is not installed"
    from apiary.kernels import cpu_decode_layers

    return cpu_decode_layers.stackable(weights, biases)


def stack_layers(first: int, layers: list[dict[str, StackWeight]], input_norms: list[torch.Tensor],
                 post_norms: list[torch.Tensor], kernel: str | None = None) -> LayerStack:
    """Consecutive decoder layers from ``first`` (each ``layer_stackable``) stacked for ``CpuStep.stacked_layers``,
    the step's decode rows through all of them in one compiled call; ``kernel``: int8 weights' grouped GEMM
    (default: the best here). The layers then hold ``LayerStack.views()``, so the weights are held once."""
    from apiary.kernels import cpu_decode_layers

    return cpu_decode_layers.stack(first, layers, input_norms, post_norms, kernel)


def bf16_gemm_available() -> bool:
    """The bf16 GEMM (``apiary.kernels.cpu_bf16_gemm``) serves CPU layers here: the ``auto`` backend, numba installed
    and compiling for ``avx512bf16``."""
    if get_backend() != "auto" or not numba_available():
        return False
    from apiary.kernels import cpu_bf16_gemm  # imports numba: only once a bf16 CPU engine or layer asks

    return cpu_bf16_gemm.available()


def bind_bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BoundBF16 | None:
    """``f(x) = x @ weight.T + bias`` through the bf16 GEMM (``apiary.kernels.cpu_bf16_gemm``: ``vdpbf16ps``, float32
    sums rounded once, as oneDNN's), for a bf16 CPU weight a layer calls every step; None where that kernel does
    not run (another backend forced, no numba, a CPU numba does not compile ``avx512bf16`` for, another dtype or
    device), so the caller keeps its own path. ``f(x, gated=False)`` takes 2-D bf16 CPU rows of ``weight``'s input
    width (``gated``: twice that, ``[gate | up]``, for ``silu(gate) * up``); ``f.weight`` is the packed weight."""
    _check_tensor("weight", weight, 2, float_=True)
    if bias is not None:
        _check_tensor("bias", bias, 1, float_=True)
        _check(bias.shape[0] == weight.shape[0], lambda: f"bias has {bias.shape[0]} values for {weight.shape[0]} outputs")
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not bf16_gemm_available():
        return None
    from apiary.kernels import cpu_bf16_gemm

    return cpu_bf16_gemm.Bound(cpu_bf16_gemm.pack(weight, bias))


def bf16w_gemm_available() -> bool:
    """The bf16-weight float32 GEMM (``apiary.kernels.cpu_bf16w_gemm``) serves CPU layers here: the ``auto`` backend,
    numba installed and compiling for AVX2 and FMA."""
    if get_backend() != "auto" or not numba_available():
        return False
    from apiary.kernels import cpu_bf16w_gemm  # imports numba: only once an engine with bf16 weights asks

    return cpu_bf16w_gemm.available()


def bind_bf16w_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BoundBF16W | None:
    """``f(x) = x @ weight.T + bias`` for float32 rows, with ``weight`` rounded to bf16 and widened in registers
    (``apiary.kernels.cpu_bf16w_gemm``: float32 products and sums, half the weight bytes of float32); None where
    that kernel does not run (another backend forced, no numba, no AVX2 + FMA, a weight off the CPU), so the caller
    keeps its own path. ``f.weight`` is the packed weight."""
    _check_tensor("weight", weight, 2, float_=True)
    if bias is not None:
        _check_tensor("bias", bias, 1, float_=True)
        _check(bias.shape[0] == weight.shape[0], lambda: f"bias has {bias.shape[0]} values for {weight.shape[0]} outputs")
    if weight.device.type != "cpu" or not bf16w_gemm_available():
        return None
    from apiary.kernels import cpu_bf16w_gemm

    return cpu_bf16w_gemm.Bound(cpu_bf16w_gemm.pack(weight, bias))


def bind_held_bf16(weight: HeldBF16) -> BoundBF16W:
    """``bind_bf16w_linear`` for a weight already packed (a view of a ``LayerStack``, ``LayerStack.views``)."""
    from apiary.kernels import cpu_bf16w_gemm

    return cpu_bf16w_gemm.Bound(weight)


def bind_packed_bf16(weight: PackedBF16) -> BoundBF16:
    """``bind_bf16_linear`` for a weight already packed (a view of a ``LayerStack``, ``LayerStack.views``)."""
    from apiary.kernels import cpu_bf16_gemm

    return cpu_bf16_gemm.Bound(weight)


def grouped_int8_reference(x: torch.Tensor, weight: GroupedWeight) -> torch.Tensor:
    """What ``grouped_int8_linear`` computes, in float64 torch ops (probes and tests)."""
    return _cpu_int8_gemm().reference(x, weight)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) symmetric int8 of ``x[M, K]``: ``(q int8, scale [M, 1] float32)``, ``x ~= q * scale``.

    On CPU, float32/bfloat16 inputs of ``NUMBA_QUANT_MIN_ROWS`` rows or more go to the numba kernel
    (``apiary.kernels.cpu_quant``: one call instead of five torch ops, ~2x faster, identical results);
    everything else to the torch reference, which the ``torch`` backend also forces.
    """
    _check_tensor("x", x, 2, float_=True)
    if _numba_serves(x) and x.shape[0] >= NUMBA_QUANT_MIN_ROWS:
        from apiary.kernels import cpu_quant  # imports numba: only once a CPU quantization runs

        return cpu_quant.quantize_rows(x)
    return reference.quantize_rows(x)


def refine_logits(hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor,
                  bitmask: torch.Tensor | None = None, candidates: int | None = None) -> torch.Tensor:
    """Logits of an approximate LM head made exact where they can win, in place: each row's ``candidates``
    largest, and where the grammar's ``bitmask`` ``[rows, W]`` (int32, bit j of word w: token 32w + j) restricts
    the row, its largest allowed ones, become ``hidden @ weight.T`` summed in float32, not rounded
    (``apiary.kernels.cpu_head``). ``hidden [rows, H]`` and ``weight [V, H]`` float32 or bfloat16, ``logits
    [rows, V]`` float32, all on the CPU. Returns ``logits``."""
    from apiary.kernels import cpu_head  # imports numba: only once an approximate head runs

    for name, t in (("hidden", hidden), ("weight", weight), ("logits", logits)):
        _check_tensor(name, t, 2, float_=True)
        _check(t.device.type == "cpu", lambda: f"refine_logits is a CPU kernel; {name} is on {t.device}")
    _check(hidden.dtype in NUMBA_DTYPES and weight.dtype in NUMBA_DTYPES,
           lambda: f"hidden and weight must be float32 or bfloat16, got {hidden.dtype} and {weight.dtype}")
    _check(logits.dtype == torch.float32 and logits.is_contiguous(), lambda: "logits must be contiguous float32")
    _check(hidden.shape[1] == weight.shape[1] and tuple(logits.shape) == (hidden.shape[0], weight.shape[0]),
           lambda: f"shapes do not fit: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                   f"logits {tuple(logits.shape)}")
    if bitmask is not None:
        _check_tensor("bitmask", bitmask, 2)
        _check(bitmask.dtype == torch.int32 and bitmask.shape[0] == logits.shape[0],
               lambda: f"bitmask must be int32 [{logits.shape[0]}, W], got {bitmask.dtype} {tuple(bitmask.shape)}")
    k = cpu_head.CANDIDATES if candidates is None else candidates
    _check(k >= 1, lambda: f"candidates must be >= 1, got {k}")
    if logits.shape[0]:
        cpu_head.refine(hidden.contiguous(), weight.contiguous(), logits, bitmask, k)
    return logits
