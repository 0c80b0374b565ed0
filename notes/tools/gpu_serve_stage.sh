#!/usr/bin/env bash
# Start the server on a preset with random weights, wait for /health, run the serving
# benchmark once per level, stop the server. Args: MODEL PORT LEVEL... where a LEVEL is
# a concurrency c (N = max(4c, 64) requests) or c:N.
# Env: TP=N serves with --tp N; SERVER_ARGS more server flags; BENCH_ARGS more benchmark
# flags (e.g. --label eager). The server log lands in $OUT/server-PORT.log however the
# stage ends (also when gpu_call.sh's timeout stops it).
set -u
model=$1 port=$2; shift 2
out=${OUT:-notes/results}
t0=$(date +%s)
python3 -m mstar.runtime.serve --model "$model" --random-weights --port "$port" --tp "${TP:-1}" --no-access-log ${SERVER_ARGS:-} > "$out/server-$port.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || break  # the server exited: do not wait out the loop
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server did not come up"; tail -50 "$out/server-$port.log"; exit 1; }
echo "server up in $(( $(date +%s) - t0 )) s"
rc=0
for level in "$@"; do
  c=${level%%:*}
  args=(--base-url "http://127.0.0.1:$port" --model "$model" --tp "${TP:-1}" --concurrency "$c" --results-dir "$out")
  [ "$level" != "$c" ] && args+=(--num-prompts "${level#*:}")
  # shellcheck disable=SC2206
  args+=(${BENCH_ARGS:-})
  python3 -m mstar.bench.serve "${args[@]}" 2>&1 | grep -v "^backend\|^---\|^appended" || rc=1
  # how requests entered steps so far (cumulative; engine_core.py stats)
  curl -s "http://127.0.0.1:$port/metrics" | sed -n 's/^mstar_engine_stat{name="\(num_steps\|num_prefill_steps\|num_admission_steps\|num_admitted\|admission_wait_seconds\)"} /\1=/p' | tr '\n' ' '; echo
done
tail -3 "$out/server-$port.log"
exit $rc
