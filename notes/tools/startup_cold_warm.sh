#!/usr/bin/env bash
# Cold vs warm process start to first token for the Qwen3.5-0.8B preset (random bf16 weights,
# one 256-token prompt, first token only), on the GPU host:
#
#   source .gpu/setup.sh && bash notes/tools/startup_cold_warm.sh
#
# cold: a fresh cache root (Triton, Inductor and FlashInfer caches empty; the CuTe entries are
#       copied in, since the host has no DSL to build them and they only load there anyway)
# warm: the same root again, now filled by the cold run.
# Each run is one fresh process, timed from just before the interpreter starts (bash
# EPOCHREALTIME) to the first token; capped at 540 s. Prints one line per run.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(mktemp -d /tmp/mstar-kc-startup.XXXXXX)
[ -d kernel_cache/cute ] && cp -r kernel_cache/cute "$root/"
for run in cold warm; do
  t0=$EPOCHREALTIME
  MSTAR_KERNEL_CACHE=$root T0=$t0 RUN=$run timeout 540 python - <<'PY'
import os, time
from mstar import LLM, SamplingParams
t_import = time.time()
llm = LLM("qwen3.5-0.8b", random_weights=True, dtype="bfloat16", device="cuda", max_num_seqs=8)
t_load = time.time()
out = llm.generate([[1000 + i for i in range(256)]], SamplingParams(max_tokens=1, temperature=0.0))
t_tok = time.time()
t0 = float(os.environ["T0"])
print(f"{os.environ['RUN']:>4}: start->first token {t_tok - t0:7.1f}s  (imports {t_import - t0:.1f}s, "
      f"engine build {t_load - t_import:.1f}s, first request {t_tok - t_load:.1f}s)", flush=True)
PY
  echo "$run exit $?"
done
python -m mstar.ops.cache --root "$root" ls | tail -8
