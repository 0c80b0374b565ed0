#!/usr/bin/env bash
# One device call: set up the bundle, untar carried caches, run the stages given as
# arguments (each "NAME:LIMIT_S:COMMAND"), pack the kernel caches back into $OUT.
#   bash notes/tools/gpu_call.sh "tests:300:python3 -m pytest -m gpu -q tests/test_decode_graphs.py"
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/setup.sh
# pip gives the bundle's files (tvm-ffi's headers among them) fresh mtimes on every new host, and
# ninja then rebuilds the carried FlashInfer objects that include them (~2 min for the head_dim 256
# prefill module): date the bundle back, older than any carried object
find /opt/mstar-gpu -exec touch -h -d 2026-01-01 {} + 2>/dev/null
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
# the carried cache: KCACHE_DIR (default kernel_cache_in) holds kcache.tgz.* (a split tar.gz)
kc=${KCACHE_DIR:-kernel_cache_in}
if [ -d "$kc" ]; then cat "$kc"/kcache.tgz.* 2>/dev/null | tar xzf - 2>/dev/null; fi
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}; fi
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; cmd=${rest#*:}
  echo "=== $name ($(date -u +%T), limit ${limit}s)" | tee -a "$OUT/log"
  # the stage's output goes to $OUT/log as it comes (a call cut short keeps it); the tail to stdout
  timeout "$limit" bash -c "$cmd" 2>&1 | tee -a "$OUT/log" > /tmp/stage.log; rc=${PIPESTATUS[0]}
  tail -n 40 /tmp/stage.log
  echo "=== $name rc=$rc" | tee -a "$OUT/log"
done
if [ "${PACK_CACHE:-1}" = 1 ]; then tar czf - kernel_cache 2>/dev/null | split -b 15m - "$OUT/kcache.tgz."; fi
