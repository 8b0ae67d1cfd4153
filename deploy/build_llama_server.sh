#!/usr/bin/env bash
# Builds llama.cpp's own OpenAI-compatible server (llama-server) from the llama.cpp sources vendored
# in llama-cpp-python's source distribution (no other download: the registry is what these machines
# reach), into .venv/llama-server/llama-server. It is the upstream the cloud's backend="openai" is
# tested against and the peer `apiary bench engine --systems llama-server` measures. The build takes
# ~25 min on a busy 2-core machine, so a marker records the CMake flags it was built with and a run
# with the same flags (the same CPU features) returns at once; a different CPU rebuilds it.
# Usage: bash deploy/build_llama_server.sh [--force]    (PYTHON=… picks the interpreter with pip;
# LLAMA_CPU_FLAGS=… builds for other CPU features, deploy/llama_cpp_flags.sh; OUT=… another folder for it)
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/llama_cpp_flags.sh

version=0.3.36
out=${OUT:-.venv/llama-server}
marker=$out/.build-flags
cmake_args="$(llama_cpp_cmake_args) -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
wanted="llama-cpp-python==$version $cmake_args"

if [ "${1:-}" != "--force" ] && [ -x "$out/llama-server" ] && [ "$(cat "$marker" 2>/dev/null)" == "$wanted" ]; then
  echo "llama-server is built for these flags: $out/llama-server"
  exit 0
fi

python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-$version.tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "no vendored llama.cpp in the llama-cpp-python $version sdist" >&2; exit 1; }

jobs=${JOBS:-$(nproc)}
# shellcheck disable=SC2086  # the flags are words
cmake -S "$src" -B "$work/build" $cmake_args >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j"$jobs" >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }

mkdir -p "$out"
rm -f "$out/llama-server" "$marker"
# Static libraries (BUILD_SHARED_LIBS=OFF): the one binary runs from anywhere, with no build tree beside it.
cp "$work/build/bin/llama-server" "$out/llama-server"
"$out/llama-server" --version >/dev/null 2>&1
echo "$wanted" > "$marker"
echo "built $out/llama-server"
