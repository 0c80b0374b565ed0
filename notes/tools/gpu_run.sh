#!/usr/bin/env bash
# One call on the GPU host, several stages, each with its own time limit; logs and results
# land in $OUT (the device tool brings them back). Compiled kernel caches come back as
# $OUT/kcache.tgz.* (split under 15 MB) and go out again by carrying kernel_cache/.
#   bash notes/tools/gpu_run.sh info tests bench offline serve cute
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
if [ -d kernel_cache_in ]; then cat kernel_cache_in/kcache.tgz.* 2>/dev/null | tar xzf - 2>/dev/null; fi
# every stage's output goes to one log ($OUT/log); the device tool brings back 8 files at most
stage() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%T))" | tee -a "$OUT/log"
  timeout "$limit" "$@" > /tmp/stage.log 2>&1; local rc=$?; cat /tmp/stage.log >> "$OUT/log"
  tail -n 30 /tmp/stage.log; echo "=== $name rc=$rc" | tee -a "$OUT/log"; }
for s in "$@"; do
  case $s in
    info) stage info 120 bash -c 'nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"; python3 -m mstar.ops' ;;
    tests) stage tests 420 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/ ;;
    bench) stage bench 420 python3 -m pytest bench/ -q -p no:cacheprovider --ops-json "$OUT/ops-cuda.json" ;;
    offline) stage offline 400 python3 -m mstar.bench.offline --model qwen3.5-0.8b --random-weights --concurrency 8 32 --out "$OUT/offline.jsonl" ;;
    *) stage "$s" 400 bash -c "$s" ;;
  esac
done
tar czf - kernel_cache 2>/dev/null | split -b 15m - "$OUT/kcache.tgz."
ls -la "$OUT" | tail -n +2
