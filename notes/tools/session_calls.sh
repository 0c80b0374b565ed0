#!/usr/bin/env bash
# The device calls notes/NEXT.md plans, each one command (the device tool takes 2,000 characters):
#
#   set -o pipefail; GIT_COMMIT=<sha> bash notes/tools/session_calls.sh check 2>&1 | tee $OUT/out.txt
#
#   check  (one H200, ~9 min): GPU tests of the last CPU-only work, the step profile, the served
#          0.8B table, then the same server with prefill graphs (A/B)
#   4b     (one H200, ~5 min): the served 4B row, and the 0.8B server with the idle gather (A/B)
#   ab     (one H200, ~9 min): decode-step A/Bs on the offline engine (--compile decode, the
#          reference system's five knobs), c8 / c32 / c128
#   tp     (two H200s, ~8 min): the tp GPU tests, 9B at TP2, one point with phase timing
#   tp2    (two H200s, ~6 min): 9B at TP2 with prefill graphs, and with the symm_mem all-reduce
#   hf     (one H200, ~5 min): HF transformers generate at c8 and c32 (BENCH.md's baseline)
#   par    (two H200s, ~9.5 min): GPU 0 serves 0.8B (default, prefill graphs, idle gather) and 4B;
#          GPU 1 runs the Whisper protocol, the gate on the trained checkpoint (.gate_model, carry
#          it) and HF at c8 / c32
#   par2   (two H200s, ~9.5 min): GPU 0: the CuTe check, then cold vs warm start-up (carry .gpu with
#          the CuTe runtime and kernel_cache/cute, no kernel_cache_in: the cold run must build);
#          GPU 1: the Whisper protocol (default, then --admit-min-free 0), the prefill-graphs probe
#   par3   (two H200s, ~6 min): GPU 0: the CuTe check, HF at c8, Whisper's decode graph replay time;
#          GPU 1: the gate on the trained
#          checkpoint (.gate_model), then the prefill-graphs probe. Carry .gpu (with the CuTe
#          runtime), kernel_cache/cute, .gate_model; no kernel cache fits beside them (kernels build)
# All of them take ~42 min: more than a session's 30. Pick by what the issues still lack.
# Carry: .gpu (CuTe xz moved aside), kernel_cache_in, .whl. Records land in $OUT. DRY=1 prints the stages.
set -u
cd "$(dirname "$0")/../.."
export PACK_CACHE=${PACK_CACHE:-0}
# DRY=1: print the stages ("NAME:LIMIT:COMMAND") instead of running them
run() { if [ -n "${DRY:-}" ]; then printf '%s\n' "$@"; else bash notes/tools/gpu_call.sh "$@"; fi; }
serve() { echo "bash notes/tools/gpu_serve_stage.sh $*"; }
case "${1:-}" in
  check)
    run "tests:200:python3 -m pytest -m gpu -q tests/test_ops_conv1d_prefill_triton.py tests/test_prefill_graphs.py \
tests/test_gpu_backends.py tests/test_gpu_sampling.py tests/test_decode_graphs.py \
-k 'conv or paged_attention or noisy or planned_path or knobs or (matches_eager and off) or forward'" \
        "profile:70:python3 notes/tools/profile_step.py --model qwen3.5-0.8b --rows 8 --prompt-len 256" \
        "serve08:120:$(serve qwen3.5-0.8b 8001 8 32 64 128 1)" \
        "serve08pg:110:SERVER_ARGS='--prefill-graphs auto' BENCH_ARGS='--label prefill-graphs' $(serve qwen3.5-0.8b 8002 8 32 128)"
    ;;
  ab)
    run "ab:480:for k in '' MSTAR_KV_PLAN_CACHE=1 MSTAR_INGRAPH_DECODE_TOKENS=1 \
'MSTAR_INGRAPH_DECODE_TOKENS=1 MSTAR_INGRAPH_DECODE_ROPE=1' MSTAR_KV_PINNED_INDPTRS=1 MSTAR_KV_CHAIN_LAZY_STEPS=8; do \
env \$k python3 -m mstar.bench.offline --model qwen3.5-0.8b --random-weights --one-engine --concurrency 8 32 128 \
--out \$OUT/ab.jsonl; done; python3 -m mstar.bench.offline --model qwen3.5-0.8b --random-weights --one-engine \
--concurrency 8 32 128 --compile decode --out \$OUT/ab.jsonl"
    ;;
  tp)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    off="python3 -m mstar.bench.offline --model qwen3.5-9b --random-weights --tp 2 --one-engine --out \$OUT/offline.jsonl"
    run "tptests:150:python3 -m pytest -m gpu -q tests/test_tp_allreduce.py tests/test_prefill_graphs.py tests/test_tp.py -k 'tp2 or symm or cuda_graphs'" \
        "tp9b:200:$off --concurrency 8 32 64 128" \
        "tpphase:90:MSTAR_PHASE_TIMING=1 MSTAR_PHASE_LOG=\$OUT/phase-tp.jsonl $off --concurrency 8 --num-prompts 16 --out ''"  # timed steps: no record
    ;;
  tp2)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    off="python3 -m mstar.bench.offline --model qwen3.5-9b --random-weights --tp 2 --one-engine --out \$OUT/offline.jsonl"
    run "tp9bpg:170:$off --concurrency 8 32 128 --prefill-graphs auto" \
        "tp9bsymm:150:MSTAR_TP_ALLREDUCE=symm_mem $off --concurrency 8 32 128"
    ;;
  4b)
    run "serve4b:160:$(serve qwen3.5-4b 8004 8 32 64 128)" \
        "gather:90:MSTAR_IDLE_GATHER_US=3000 BENCH_ARGS='--label gather3000' $(serve qwen3.5-0.8b 8003 8 32)"
    ;;
  hf)
    run "hf:230:for c in 8 32; do python3 -m mstar.bench.serve --backend hf --model qwen3.5-0.8b --random-weights \
--concurrency \$c --num-prompts \$c --results-dir \$OUT; done"
    ;;
  par)
    g0="$(serve qwen3.5-0.8b 8001 8 32 64 128); \
SERVER_ARGS='--prefill-graphs auto' BENCH_ARGS='--label prefill-graphs' $(serve qwen3.5-0.8b 8002 8 32 64 128); \
MSTAR_IDLE_GATHER_US=3000 BENCH_ARGS='--label gather3000' $(serve qwen3.5-0.8b 8003 8 32); $(serve qwen3.5-4b 8004 8 32 64 128)"
    g1="timeout 230 python3 -m mstar.bench.whisper --launch --model whisper-large-v3 --results-dir \$OUT \
--server-args --port 8101; timeout 150 python3 -m mstar.bench.gate --model .gate_model --out \$OUT/gate-trained.json; \
for c in 8 32; do timeout 100 python3 -m mstar.bench.serve --backend hf --model qwen3.5-0.8b --random-weights \
--concurrency \$c --num-prompts \$c --results-dir \$OUT; done"
    run "par:560:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; cd \$OUT && tar czf servers.tgz server-*.log && rm -f server-*.log; grep -h -v "^INFO" gpu0.log gpu1.log | tail -80"
    ;;
  par2)
    w="python3 -m mstar.bench.whisper --launch --model whisper-large-v3 --results-dir \$OUT"
    g0="timeout 150 bash notes/tools/gpu_cute_check.sh; timeout 380 bash notes/tools/startup_cold_warm.sh"
    g1="timeout 230 $w --server-log \$OUT/whisper-a.log; \
timeout 120 $w --label admit0 --server-log \$OUT/whisper-b.log --server-args --admit-min-free 0; \
timeout 170 python3 notes/tools/pg_decode_probe.py --model qwen3.5-0.8b --batch 8 32 128"
    run "par2:570:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; cd \$OUT && tar czf wlogs.tgz whisper-*.log \
&& rm -f whisper-*.log; grep -h -v '^INFO' gpu0.log gpu1.log | tail -100"
    ;;
  par3)
    g0="timeout 160 bash notes/tools/gpu_cute_check.sh; timeout 140 python3 -m mstar.bench.serve --backend hf \
--model qwen3.5-0.8b --random-weights --concurrency 8 --num-prompts 8 --results-dir \$OUT; \
timeout 110 python3 notes/tools/pg_decode_probe.py --model whisper-large-v3 --batch 1 4 16 --decode-only"
    g1="timeout 280 python3 -m mstar.bench.gate --model .gate_model --out \$OUT/gate-trained.json; \
timeout 120 python3 notes/tools/pg_decode_probe.py --model qwen3.5-0.8b --batch 8 32 128"
    run "par3:420:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; grep -h -v '^INFO' \$OUT/gpu0.log \$OUT/gpu1.log | tail -120"
    ;;
  *)
    sed -n 2,25p "$0"
    exit 2
    ;;
esac
