#!/usr/bin/env bash
# CMake flags for building llama.cpp on this CPU, shared by .ci/install (llama-cpp-python) and
# deploy/build_llama_server.sh (llama.cpp's own server), so both are built for the same features.
# Explicit per-feature flags rather than GGML_NATIVE, and never the AMX backend: on hosts that
# list AMX its tile code faults (SIGSEGV at model load, seen on a Xeon with amx_int8 on 2026-12-02).
# Source this file and call llama_cpp_cmake_args; it prints the flags on one line.
# LLAMA_CPU_FLAGS="avx avx2 fma f16c bmi2" builds for those features instead of this CPU's (a lesser
# CPU's build, to rehearse such a host on this one: docs/benchmarks.md "An AVX2 host, rehearsed").
llama_cpp_cmake_args() {
  local flags cmake_args pair feature option
  flags=${LLAMA_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo || true)}
  cmake_args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 avx_vnni:GGML_AVX_VNNI \
              avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16; do
    feature=${pair%%:*}; option=${pair#*:}
    if [[ " $flags " == *" $feature "* ]]; then cmake_args+=" -D$option=ON"; else cmake_args+=" -D$option=OFF"; fi
  done
  echo "$cmake_args"
}
