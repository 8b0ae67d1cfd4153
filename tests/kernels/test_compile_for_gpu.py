"""Compile every Triton kernel for H100/H200 (sm_90) without needing a GPU.

The interpreter checks the kernels' logic but is more permissive than the compiler; this runs the
real Triton pipeline down to ptxas, so type errors, unsupported constructs and shared-memory
overflows in the compiled path surface on CPU-only machines too. It runs in a subprocess because
this test session imports the kernels in interpreter mode. On a CUDA machine the CUDA variants of
the other tests compile and run the kernels for real, so this is skipped there. To stay fast it
compiles the fullest variant of each kernel, in bf16 (fp16 takes the same path) and, for attention,
fp32 (exact "ieee" dots); every variant and dtype for sm_90 and sm_80 was checked by hand once
(docs/kernels.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from apiary.kernels import ops

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from apiary.kernels import kv_cache, paged_attention as pa, rms_norm, rotary

    def build(fn, dt, types, constexprs):
        sig = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        smem = compiled.metadata.shared
        assert smem <= 227 * 1024, f"{fn.__name__} ({dt}) needs {smem} bytes of shared memory"
        print(fn.__name__, dt, "shared", smem)

    for dt, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        attn = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        attn.update(block_tables_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_ptr="*i32", tile_seq_ptr="*i32",
                    tile_first_ptr="*i32", part_acc_ptr="*fp32", part_ml_ptr="*fp32", scale_log2="fp32")
        shape = dict(BLOCK_SIZE=16, HEAD_DIM=128, D_PAD=128, PRECISION=precision, DOT_F32=False)
        # one variant each, the one with the most code: split-K decode and prefill, both with a window
        build(pa._decode_kernel, dt, attn, dict(shape, BLOCK_N=pa.DECODE_BLOCK_N, GROUP=4, GROUP_PAD=16,
                                                USE_WINDOW=True, SPLIT=True))
        build(pa._prefill_kernel, dt, attn, dict(shape, BLOCK_N=pa.PREFILL_BLOCK_N, GROUP=4, GROUP_PAD=4,
                                                 BLOCK_Q=pa.PREFILL_BLOCK_M // 4, USE_WINDOW=True))

    # dtype only changes loads and stores below, so bf16 stands for all three
    build(pa._decode_merge_kernel, "bf16", dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr="*bf16"),
          dict(HEAD_DIM=128, D_PAD=128, SPLITS_PAD=16))
    build(kv_cache._write_kv_kernel, "fp32->bf16", dict(key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr="*bf16",
                                                         v_cache_ptr="*bf16", slot_ptr="*i64"),
          dict(NUM_KV_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128))
    build(rms_norm._rms_norm_kernel, "bf16", dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*fp32",
                                                  out_ptr="*bf16", residual_out_ptr="*bf16", eps="fp32"),
          dict(HIDDEN=4096, BLOCK_H=4096, HAS_RESIDUAL=True))
    build(rotary._rotary_kernel, "bf16", dict(q_ptr="*bf16", k_ptr="*bf16", q_out_ptr="*bf16", k_out_ptr="*bf16",
                                              positions_ptr="*i64", cos_sin_ptr="*fp32"),
          dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, QH_PAD=32, KH_PAD=8, HALF=64, HALF_PAD=64))
    print("all kernels compiled")
''')


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA test variants compile and run the kernels")
@pytest.mark.skipif(not ops.triton_available(), reason="triton is not installed")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a warm cache
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "all kernels compiled" in proc.stdout
