#!/usr/bin/env bash
# The engine on a CUDA machine, in one go (each step's output under OUT_DIR, default ./cuda_check):
# a random-weight checkpoint of the default model's shape (bench/random_checkpoint.py), workload_64 in bf16 and
# fp32 (and bf16 with cuDNN's SDPA allowed, PAGELLM_SDPA_CUDNN=1), single-request latency at 128 and 512 prompt
# tokens, then the tests, whose engines take CUDA by default (the files that test the C++ CPU kernels alone are
# left out: they run on the CPU wherever they run).
#   bench/cuda_check.sh [WORKLOAD]
# Needs the package importable (pip install -e ., or PYTHONPATH=.); tests on the default model need its file in
# the cache dir ($PAGELLM_CACHE), or a network to fetch it.
# On a machine lent for 10 minutes a call, keep the whole under that: the benchmarks stop at BENCH_LIMIT seconds
# each (default 150; bf16 took ~20 s on an H200, so a run that stops there has found the slowdown), the tests at
# PYTEST_LIMIT (default 600; e.g. OUT_DIR=$OUT/cuda_check PYTEST_LIMIT=200 bench/cuda_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${1:-../shared/workloads/workload_64.json}
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-cuda_check}
BENCH_LIMIT=${BENCH_LIMIT:-150}
mkdir -p "$OUT_DIR"
CKPT=$(mktemp -d)
# After a benchmark: a newline after its JSON line, or a line saying how it ended (124: stopped at its limit).
said() { echo; [ "$2" -eq 0 ] || echo "# $1: exit $2$([ "$2" -eq 124 ] && echo ", stopped at its limit")"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/env.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT_DIR/env.txt"
{ lscpu | grep -E "Model name|Flags"; g++ --version | head -1; } >>"$OUT_DIR/env.txt" 2>&1
# The first run on an H200 crashed Python (SIGSEGV) where a C++ kernel must raise RuntimeError for a bad argument;
# the kernels' own refusals, alone, say whether every C++ error crashes there or that call only.
timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_cpu_kernels.py::test_bad_shapes_are_refused_clearly \
  "tests/test_attention.py::test_attention_writes_this_steps_rows_as_write_kv_cache_does[cache_dtype0]" \
  >"$OUT_DIR/cpu_kernel_errors.txt" 2>&1; echo "CPU kernels' refusals: exit $?" | tee -a "$OUT_DIR/env.txt"
$PY bench/random_checkpoint.py "$CKPT" >/dev/null 2>"$OUT_DIR/checkpoint.log" || { echo "checkpoint failed"; exit 1; }
{
  for dtype in bfloat16 float32; do
    timeout "$BENCH_LIMIT" $PY -m pagellm bench throughput --model "$CKPT" --workload "$WORKLOAD" --dtype "$dtype"
    said "throughput $dtype" $?
  done
  # the same bf16 run with cuDNN's attention allowed in SDPA again (attention.py's CUDA_SDPA_BACKENDS: left out
  # because it builds a plan per new shape), to see what leaving it out gives
  PAGELLM_SDPA_CUDNN=1 timeout "$BENCH_LIMIT" $PY -m pagellm bench throughput --model "$CKPT" --workload "$WORKLOAD" \
    --dtype bfloat16
  said "throughput bfloat16, PAGELLM_SDPA_CUDNN=1" $?
  for len in 128 512; do
    timeout 120 $PY -m pagellm bench latency --model "$CKPT" --dtype bfloat16 --input-len $len --output-len 128
    said "latency $len" $?
  done
} >"$OUT_DIR/bench.jsonl" 2>"$OUT_DIR/bench.log"
cat "$OUT_DIR/bench.jsonl"
# With pytest-xdist, one worker: a test that crashes Python costs its worker, not the rest of the run.
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-p xdist -n 1")
timeout "${PYTEST_LIMIT:-600}" $PY -m pytest -q -p no:cacheprovider -rfE $XDIST \
  --ignore=tests/test_cpu_kernels.py --ignore=tests/test_fused_decoder.py --ignore=tests/test_gguf_linear.py \
  --ignore=tests/test_fp16_linear.py --ignore=tests/test_fp16_attention.py tests >"$OUT_DIR/pytest.txt" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest.txt" | cut -c1-200
tail -1 "$OUT_DIR/pytest.txt"
rm -rf "$CKPT"
