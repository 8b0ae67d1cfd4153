#!/bin/bash
# `apiary bench gpu` on a lent GPU machine whose image has torch/Triton but not this package or all its needs.
# Prepare here, in the checkout (both folders are git-ignored via .git/info/exclude, and carried):
#   apiary bench stand_in .gpu/stand-in          # SmolLM2's config + tokenizer (the 98 MB model cannot travel)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#       pydantic pydantic_core annotated-types typing-inspection typing_extensions paho-mqtt \
#       cryptography cffi pycparser gguf     # versions as installed here; the last four for the shipped edge student
# Then there, from the checkout's root:  BUDGET=420 bash bench/device_run.sh   (logs and JSON land in $OUT)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
# The apiary.* namespace over the checkout's folders (what the editable install's finder does elsewhere).
mkdir -p /tmp/ns/apiary && cp apiary/*.py /tmp/ns/apiary/
for d in shared edge cloud kernels firmware_bridge deploy bench; do ln -sfn "$PWD/$d" /tmp/ns/apiary/$d; done
export PYTHONPATH=/tmp/ns:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
REPO=$PWD; mkdir -p /tmp/work && cd /tmp/work  # not the checkout: its apiary/ would shadow the namespace
python3 -m apiary bench gpu --stand-in "$REPO/.gpu/stand-in" --budget-s "${BUDGET:-420}" --out "${OUT:-/tmp/out}/check" 2>&1 \
    | tee "${OUT:-/tmp/out}/run.log"
rc=$?
cp results/bench/gpu.json "${OUT:-/tmp/out}/" 2>/dev/null
tail -c 6000 "${OUT:-/tmp/out}/check/tests.log"; echo; tail -c 4000 "${OUT:-/tmp/out}/check/kernels.log"
exit $rc
