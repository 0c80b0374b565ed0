#!/usr/bin/env bash
# Start the server on a preset with random weights, wait for /health, run the serving
# benchmark at the given concurrencies, stop the server. Args: MODEL PORT NUM_PROMPTS C...
set -u
model=$1 port=$2 n=$3; shift 3
# TP=N in the environment: serve with --tp N (and record tp=N); SERVER_ARGS: more server flags;
# BENCH_ARGS: more benchmark flags (e.g. --label eager)
python3 -m mstar.runtime.serve --model "$model" --random-weights --port "$port" --tp "${TP:-1}" --no-access-log ${SERVER_ARGS:-} > /tmp/server.log 2>&1 &
pid=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || break  # the server exited: do not wait out the loop
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" || { echo "server did not come up"; tail -50 /tmp/server.log; kill $pid; exit 1; }
args=(--base-url "http://127.0.0.1:$port" --model "$model" --tp "${TP:-1}" --concurrency "$@" --results-dir "${OUT:-notes/results}")
[ "$n" != "0" ] && args+=(--num-prompts "$n")
# shellcheck disable=SC2206
args+=(${BENCH_ARGS:-})
python3 -m mstar.bench.serve "${args[@]}"
rc=$?
kill -TERM $pid; wait $pid
tail -5 /tmp/server.log
exit $rc
