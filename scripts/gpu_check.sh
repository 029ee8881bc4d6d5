#!/usr/bin/env bash
# The GPU path's checks in one device call (docs/benchmarks.md, "GPU"). Prepared on the CPU:
#
#   # here, once: wheels the GPU machine lacks, and the bundled tokenizer as a HF directory
#   scripts/gpu_check.sh --prepare
#   # then one device call, carrying both:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=590)
#
# On the GPU machine (no package index; torch, triton, transformers, aiohttp, pytest there):
# installs the carried wheels and aioengine into /tmp/site, runs the Triton kernel tests
# natively, then scripts/gpu_check.py (greedy vs transformers, TPOT vs the HBM floor,
# throughput at 64 concurrent requests vs transformers, loop overlap). Results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
  PY=${PY:-.venv/bin/python}
  platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any"
  # The runtime dependencies the GPU image lacks, at the versions of requirements.lock.
  for name in orjson xgrammar gguf jsonschema jsonschema-specifications referencing rpds-py \
              pytest-asyncio pydantic pydantic_core annotated-types typing-inspection \
              apache-tvm-ffi; do
    pin=$(grep -i "^${name}==" requirements.lock) || { echo "not in the lock: $name"; exit 1; }
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp $platforms -d .whl "$pin" || exit 1
  done
  mkdir -p .gpu
  $PY -c "from tests.tiny_models import bundled_tokenizer; bundled_tokenizer().save_pretrained('.gpu/tokenizer')"
  du -sh .whl .gpu
  exit 0
fi

OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 AIOENGINE_TEST_TOKENIZER_DIR="$PWD/.gpu/tokenizer"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
# Run from a copy of the tests and scripts only: a checkout's own aioengine/ would shadow the
# installed package, whose layout maps kernels/, spec_decode/, ... into it.
rm -rf /tmp/src && mkdir -p /tmp/src && cp -r tests scripts pyproject.toml /tmp/src/ && cd /tmp/src || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
# The kernel tests, natively (conftest runs them on CUDA when it is there).
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.txt"
tests_rc=${PIPESTATUS[0]}
timeout 420 python3 scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
check_rc=${PIPESTATUS[0]}
echo "kernel tests rc=$tests_rc, gpu_check rc=$check_rc"
exit $(( tests_rc != 0 || check_rc != 0 ))
