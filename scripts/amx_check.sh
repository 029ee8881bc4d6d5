#!/usr/bin/env bash
# The AMX path's checks in one call, on a machine whose CPU has AMX (`grep amx_tile
# /proc/cpuinfo`); docs/benchmarks.md ("Intel AMX") keeps what it measured. Run it whenever a
# session lands on such a machine:
#
#   scripts/amx_check.sh            # tests and the GEMM (~3 min)
#   scripts/amx_check.sh --e2e      # and W1 offline / decode steps, with vLLM if installed
#
# 1. the CPU and whether the kernel grants the tile state (the kernels' start-up says);
# 2. the AMX tests natively: the tiles against float64, a row's bits alone and in any
#    step, and the emulation bit-equal to the hardware on random inputs (the proof that
#    the tests every other machine runs on the emulation hold for the hardware);
# 3. the bf16 GEMM per row count: AMX tiles, the AVX512-BF16 kernel and oneDNN's bf16
#    matmul (torch's linear, the local ceiling); the GGUF block formats' GEMM on int8 tiles
#    against their vector tiles;
# 4. with --e2e: W1 offline with vLLM's CPU build in the same run (docs/peers.md;
#    VLLM_PYTHON, default /work/peers/vllm/bin/python) and the decode step's cost against
#    its roofline at 1, 4 and 32 rows.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

grep -m1 "model name" /proc/cpuinfo
grep -o -w 'amx_[a-z0-9]*\|avx512_bf16\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '
echo
if ! grep -q -w amx_tile /proc/cpuinfo; then
  echo "no AMX on this CPU: nothing to check (the emulation's tests run in make test)"
  exit 0
fi
$PY -c "from aioengine.kernels import cpu; cpu.load(); print('kernels:', cpu.describe())"

echo "== native AMX tests"
$PY -m pytest -q -p no:cacheprovider tests/model/test_cpu_gemm_amx.py \
  tests/model/test_cpu_gemm.py -k "amx or tiles or bits or float64" || exit 1
$PY -m pytest -q -p no:cacheprovider tests/model/test_block_gemm_amx.py \
  tests/model/test_block_gemm.py tests/model/test_cpu_gemm_w8a8_amx.py \
  tests/model/test_cpu_gemm_w8a8.py || exit 1

echo "== bf16 GEMM over SmolLM2-135M's projections (ms per pass, GFLOP/s)"
$PY scripts/gemm_bench.py --dtype bfloat16 --builds amx,avx512_bf16,onednn \
  --rows 1,4,16,32,64,128,512 --rounds 2

echo "== GGUF block GEMM, 4096 x 4096: int8 tiles vs the vector tiles (ms per pass)"
$PY scripts/block_gemm_bench.py --types q4_k,q6_k,q4_0,q8_0 --rows 8,32,128,512

if [[ "${1:-}" == "--e2e" ]]; then
  VLLM_PYTHON=${VLLM_PYTHON:-/work/peers/vllm/bin/python}
  for round in 1 2; do
    echo "== W1 offline, round $round"
    .venv/bin/aioengine bench offline --engines aioengine --no-progress 2>&1 | grep -A1 "^engine"
    if [[ -x "$VLLM_PYTHON" ]]; then
      .venv/bin/aioengine bench offline --engines vllm --vllm-python "$VLLM_PYTHON" \
        --no-progress 2>&1 | grep -A1 "^engine" | tail -1
    fi
  done
  echo "== decode step against its roofline"
  $PY scripts/step_cost.py --dtype bfloat16 --rows 1,4,32 --repeats 2 2>&1 | grep -v "^WARN\|^INFO"
fi
