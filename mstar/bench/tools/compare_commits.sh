#!/usr/bin/env bash
# Serve two mstar trees one after the other on the same machine and compare them side by side.
#
#   bash mstar/bench/tools/compare_commits.sh OLD_TREE_DIR NEW_TREE_DIR OUT_DIR
#
# OLD_TREE_DIR / NEW_TREE_DIR: directories that hold an `mstar/` package (a checkout, or
# `git archive COMMIT mstar | tar -x -C DIR`). Each tree runs with PYTHONPATH=TREE and its own
# working directory, so its own `mstar` is imported (checked: the script stops if another copy,
# e.g. an installed one, shadows it), its own server and its own benchmark clients.
#
# What runs, in this order (ORDER=old new):
#   1. LLM: per tree a fresh server (`python -m mstar.runtime.serve MODEL --random-weights`, its own
#      port), the serving benchmark (`python -m mstar.bench.serve`) at each level of LEVELS, the
#      server stopped; one tree after the other, as ORDER says.
#   2. Whisper: per tree `python -m mstar.bench.whisper --launch` (it starts and stops its own
#      server on a free port) at WHISPER_LEVELS; in ORDER again.
# Then a table of OLD vs NEW (NEW / OLD ratios) from the records of this run.
#
# Order bias: one pass, OLD before NEW. Both trees share one kernel cache (MSTAR_KERNEL_CACHE,
# default NEW_TREE_DIR/kernel_cache: Triton, Inductor and FlashInfer's JIT builds), so on a
# fresh host OLD's server pays the first-use compiles (FlashInfer's prefill modules, ~90 s per
# head_dim) during its start-up and NEW's finds them built. The servers' start-up warm-up
# (--warmup auto: on for CUDA) and each benchmark's untimed warm-up round keep those compiles out
# of the timed requests, so the measured points compare; the start-up times do not. For a
# check against drift of the machine, ORDER="old new old" runs OLD again at the end (the table
# then shows each tree's mean, with the count).
#
# Files in OUT_DIR: server-{old,new}.log, whisper-server-{old,new}.log, llm_serve.jsonl and
# whisper.jsonl (the clients' JSON records, one a level, with label old / new and the tree's
# commit), compare.txt (the table). Records already in the .jsonl files are kept; the table
# reads only the lines this run appended.
#
# Settings (environment; the defaults are the serving protocol of notes/benchmarks.md):
#   MODEL=qwen3.5-0.8b        LLM preset or model directory (presets get --random-weights)
#   LEVELS="8 32 128"         concurrencies; c:N runs N timed requests (default max(4c, 64))
#   WHISPER_MODEL=whisper-large-v3   WHISPER_LEVELS=16   WHISPER_REQUESTS=64
#   PARTS="llm whisper"       which parts run
#   ORDER="old new"           tree order of each part (old / new, repeats allowed)
#   SERVER_ARGS=""            more server flags, both trees (e.g. "--max-num-seqs 128")
#   BENCH_ARGS=""             more mstar.bench.serve flags (e.g. "--input-len 32 --output-len 16")
#   WHISPER_ARGS=""           more mstar.bench.whisper flags (e.g. "--clip-seconds 2 --output-len 8")
#   PORT=18100                the LLM servers listen on PORT+1, PORT+2, ... in the order they start
#   START_TIMEOUT=420  LEVEL_TIMEOUT=180  WHISPER_TIMEOUT=420   seconds, each capped by BUDGET_S
#   BUDGET_S                  seconds for the whole run: later parts get what is left (10 s kept
#                             for the table) and are skipped when less than 30 s is; default none
#   PYTHON=python3
# Exit status: 0 when every part ran and no request failed, else 1.
set -uo pipefail

if [ $# -ne 3 ]; then awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; fi
abs() { (cd "$1" 2>/dev/null && pwd -P); }
OLD=$(abs "$1") || { echo "error: no directory $1" >&2; exit 2; }
NEW=$(abs "$2") || { echo "error: no directory $2" >&2; exit 2; }
mkdir -p "$3" && OUTD=$(abs "$3") || { echo "error: cannot create $3" >&2; exit 2; }
for t in "$OLD" "$NEW"; do
  [ -f "$t/mstar/__init__.py" ] || { echo "error: $t has no mstar/ package" >&2; exit 2; }
done

MODEL=${MODEL:-qwen3.5-0.8b}
LEVELS=${LEVELS:-8 32 128}
WHISPER_MODEL=${WHISPER_MODEL:-whisper-large-v3}
WHISPER_LEVELS=${WHISPER_LEVELS:-16}
WHISPER_REQUESTS=${WHISPER_REQUESTS:-64}
PARTS=${PARTS:-llm whisper}
ORDER=${ORDER:-old new}
PORT=${PORT:-18100}
START_TIMEOUT=${START_TIMEOUT:-420}
LEVEL_TIMEOUT=${LEVEL_TIMEOUT:-180}
WHISPER_TIMEOUT=${WHISPER_TIMEOUT:-420}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# one kernel cache for both trees (an absolute path: each tree runs in its own directory)
kc=${MSTAR_KERNEL_CACHE:-$NEW/kernel_cache}
mkdir -p "$kc" && export MSTAR_KERNEL_CACHE=$(abs "$kc")
BASE_PYTHONPATH=${PYTHONPATH:-}

T_END=$(( $(date +%s) + ${BUDGET_S:-1000000} ))
# seconds a step may take: its own limit, capped by what the budget has left (less 10 s for the table)
limit() { local left=$(( T_END - $(date +%s) - 10 )); [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
log() { echo "== $(date -u +%T) $*"; }

tree_of() { [ "$1" = old ] && echo "$OLD" || echo "$NEW"; }

# the commit a tree holds: TREE/COMMIT (written next to an archive), else git when TREE is a
# checkout's root (+ -dirty), else unknown
commit_of() {
  local t=$1
  if [ -f "$t/COMMIT" ]; then head -n1 "$t/COMMIT"; return; fi
  if [ "$(git -C "$t" rev-parse --show-toplevel 2>/dev/null)" = "$t" ]; then
    local c; c=$(git -C "$t" rev-parse --short HEAD)
    [ -n "$(git -C "$t" status --porcelain --untracked-files=no 2>/dev/null)" ] && c="$c-dirty"
    echo "$c"; return
  fi
  echo unknown
}

# run a command inside a tree: its directory, its mstar first on the path, its commit for the records
in_tree() {
  local t=$1; shift
  (cd "$t" && PYTHONPATH="$t${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}" GIT_COMMIT="$(commit_of "$t")" "$@")
}

for label in $ORDER; do
  case $label in old|new) ;; *) echo "error: ORDER takes old / new, not $label" >&2; exit 2 ;; esac
done
for part in $PARTS; do
  case $part in llm|whisper) ;; *) echo "error: PARTS takes llm / whisper, not $part" >&2; exit 2 ;; esac
done
for label in old new; do
  t=$(tree_of $label)
  got=$(in_tree "$t" "$PYTHON" -c 'import os, mstar; print(os.path.dirname(os.path.realpath(mstar.__file__)))' 2>&1)
  if [ "$got" != "$t/mstar" ]; then
    echo "error: the $label tree's mstar does not import from $t/mstar (got: $got)" >&2; exit 2
  fi
  log "$label: $t (commit $(commit_of "$t"))"
done
log "kernel cache: $MSTAR_KERNEL_CACHE"

# lines already in the record files: the table reads only what this run appends
declare -A SKIP
for f in llm_serve whisper; do SKIP[$f]=$( [ -f "$OUTD/$f.jsonl" ] && wc -l < "$OUTD/$f.jsonl" || echo 0); done

rc=0
SERVER_PID=
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "server $SERVER_PID did not stop in 60 s: killed"
    pkill -KILL -P "$SERVER_PID" 2>/dev/null; kill -KILL "$SERVER_PID" 2>/dev/null
  fi
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap 'stop_server' EXIT
trap 'stop_server; exit 143' TERM INT

# one LLM server for one tree, every level, then stop it
run_llm() {
  local label=$1 port=$2 t; t=$(tree_of "$1")
  local slog="$OUTD/server-$label.log" rw=()
  [ -d "$MODEL" ] || rw=(--random-weights)
  local lim; lim=$(limit "$START_TIMEOUT")
  if [ "$lim" -lt 30 ]; then log "llm $label: skipped (budget spent)"; rc=1; return; fi
  log "llm $label: starting the server on port $port (log $slog)"
  local t0; t0=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$t" && PYTHONPATH="$t${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}" exec "$PYTHON" -m mstar.runtime.serve \
      --model "$MODEL" "${rw[@]}" --port "$port" --no-access-log ${SERVER_ARGS:-}) >> "$slog" 2>&1 &
  SERVER_PID=$!
  local url=
  while [ $(( $(date +%s) - t0 )) -lt "$lim" ]; do
    url=$(grep -o "mstar is serving [^ ]* at http://[^ ]*" "$slog" 2>/dev/null | tail -n1 | sed 's/.* at //')
    [ -n "$url" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  if [ -z "$url" ]; then
    if kill -0 "$SERVER_PID" 2>/dev/null; then log "llm $label: the server did not come up in $lim s"
    else log "llm $label: the server exited after $(( $(date +%s) - t0 )) s"; fi
    tail -n 30 "$slog"
    stop_server; rc=1; return
  fi
  log "llm $label: server up in $(( $(date +%s) - t0 )) s at $url"
  for level in $LEVELS; do
    local c=${level%%:*} args=()
    [ "$level" != "$c" ] && args+=(--num-prompts "${level#*:}")
    lim=$(limit "$LEVEL_TIMEOUT")
    if [ "$lim" -lt 30 ]; then log "llm $label c$c: skipped (budget spent)"; rc=1; continue; fi
    log "llm $label c$c"
    # shellcheck disable=SC2086
    in_tree "$t" timeout "$lim" "$PYTHON" -m mstar.bench.serve --base-url "$url" --model "$MODEL" \
        --concurrency "$c" "${args[@]}" --results-dir "$OUTD" --label "$label" ${BENCH_ARGS:-} 2>&1 \
      | grep -v '^appended' || rc=1
  done
  stop_server
  tail -n 2 "$slog"
}

# Whisper for one tree: the client launches (and stops) its own server
run_whisper() {
  local label=$1 t; t=$(tree_of "$1")
  local lim; lim=$(limit "$WHISPER_TIMEOUT")
  if [ "$lim" -lt 30 ]; then log "whisper $label: skipped (budget spent)"; rc=1; return; fi
  log "whisper $label (server log $OUTD/whisper-server-$label.log)"
  # shellcheck disable=SC2086
  in_tree "$t" timeout "$lim" "$PYTHON" -m mstar.bench.whisper --launch --model "$WHISPER_MODEL" \
      --concurrency $WHISPER_LEVELS --num-requests "$WHISPER_REQUESTS" --startup-timeout "$lim" \
      --results-dir "$OUTD" --label "$label" --server-log "$OUTD/whisper-server-$label.log" ${WHISPER_ARGS:-} 2>&1 \
    | grep -v '^appended' || rc=1
}

n=0
for part in $PARTS; do
  for label in $ORDER; do
    case $part in
      llm) n=$((n + 1)); run_llm "$label" $((PORT + n)) ;;
      whisper) run_whisper "$label" ;;
    esac
  done
done

log "table"
SKIP_LLM=${SKIP[llm_serve]} SKIP_WHISPER=${SKIP[whisper]} OUTD=$OUTD "$PYTHON" - <<'PY' | tee "$OUTD/compare.txt"
import json, math, os, statistics as st

out = os.environ["OUTD"]

def records(name, skip):
    path = os.path.join(out, name + ".jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.readlines()[skip:]
    recs = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("label") in ("old", "new"):
            recs.append(r)
    return recs

def table(title, recs, cols):
    """cols: (header, field, fmt, ratio?); one row per (model, concurrency), old | new | new/old."""
    if not recs:
        print(f"{title}: no records")
        return
    commits = {lab: sorted({r.get("commit", "?") for r in recs if r["label"] == lab}) for lab in ("old", "new")}
    print(f"{title}   old={','.join(commits['old']) or '-'}  new={','.join(commits['new']) or '-'}  "
          f"gpu={recs[0].get('gpu', '?')}")
    keys = sorted({(r["model"], r["concurrency"]) for r in recs}, key=lambda k: (k[0], k[1]))
    head = f"{'model':<18} {'c':>4}"
    for h, _, _, ratio in cols:
        head += f" | {h + ' old':>13} {h + ' new':>13}" + (f" {'new/old':>7}" if ratio else "")
    head += f" | {'n':>3} {'failed':>6}"
    print(head)
    print("-" * len(head))
    for model, c in keys:
        row = f"{model:<18} {c:>4}"
        by = {lab: [r for r in recs if r["label"] == lab and r["model"] == model and r["concurrency"] == c]
              for lab in ("old", "new")}
        for _, field, fmt, ratio in cols:
            v = {}
            for lab in ("old", "new"):
                xs = [r[field] for r in by[lab] if isinstance(r.get(field), (int, float)) and math.isfinite(r[field])]
                v[lab] = st.mean(xs) if xs else None
            cell = lambda x: (fmt.format(x) if x is not None else "-")
            row += f" | {cell(v['old']):>13} {cell(v['new']):>13}"
            if ratio:
                row += f" {v['new'] / v['old']:>7.3f}" if v["old"] and v["new"] is not None else f" {'-':>7}"
        row += f" | {len(by['old'])}/{len(by['new'])} {sum(r.get('failed', 0) for r in by['old'] + by['new']):>6}"
        print(row)
    print()

table("LLM serving (output tok/s; TTFT, ITL in ms)", records("llm_serve", int(os.environ["SKIP_LLM"])),
      [("tok/s", "output_tok_s", "{:.1f}", True), ("TTFT p90", "ttft_p90_ms", "{:.1f}", False),
       ("ITL p50", "itl_p50_ms", "{:.2f}", True)])
table("Whisper (req/s; first token in ms)", records("whisper", int(os.environ["SKIP_WHISPER"])),
      [("req/s", "req_s", "{:.2f}", True), ("1st tok p90", "first_token_p90_ms", "{:.1f}", False)])
PY
exit $rc
