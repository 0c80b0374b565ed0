#!/usr/bin/env bash
# The device calls notes/NEXT.md plans, each one command (the device tool takes 2,000 characters):
#
#   set -o pipefail; GIT_COMMIT=<sha> bash notes/tools/session_calls.sh first 2>&1 | tee $OUT/out.txt
#
#   first  (two H200s, ~9 min): GPU 0: the Whisper protocol (after c256746's cross pages) and
#          Whisper's decode graph replay, then the served 4B row (prefill graphs on); GPU 1: the
#          gate on the trained checkpoint, then the prefill-graph probe with a GEMM-burst control.
#          Carry .gpu (CuTe xz moved aside), kernel_cache_slim (FlashInfer's head_dim 256 / 64
#          modules only: notes/NEXT.md), .whl, .gate_model
#   ab     (one H200, ~9 min): decode-step A/Bs on the offline engine (--compile decode, the
#          reference system's five knobs), c8 / c32 / c128
#   tp     (two H200s, ~8 min): the tp GPU tests, 9B at TP2, one point with phase timing
#   tp2    (two H200s, ~6 min): 9B at TP2 with prefill graphs, and with the symm_mem all-reduce
#   hf     (one H200, ~5 min): HF transformers generate at c8 and c32 (BENCH.md's baseline)
#   s7a-s7d: session 7's calls (notes/gpu-2026-11-30-s7.md); s8a-s8f: session 8's; s9a, s9b: what notes/NEXT.md plans next
# All of them take ~37 min: more than a session's 30. Pick by what the issues still lack.
# Carry: .gpu (CuTe xz moved aside), kernel_cache_in, .whl (64 MiB in all). Records land in $OUT.
# DRY=1 prints the stages. Session 5 ran par / par2 / par3 (in git history, notes/gpu-2026-11-30-s5.md).
set -u
cd "$(dirname "$0")/../.."
export PACK_CACHE=${PACK_CACHE:-0}
# DRY=1: print the stages ("NAME:LIMIT:COMMAND") instead of running them
run() { if [ -n "${DRY:-}" ]; then printf '%s\n' "$@"; else bash notes/tools/gpu_call.sh "$@"; fi; }
serve() { echo "bash notes/tools/gpu_serve_stage.sh $*"; }
case "${1:-}" in
  first)
    export KCACHE_DIR=kernel_cache_slim  # FlashInfer's head_dim 256 / 64 modules: the whole cache does not fit
    w="python3 -m mstar.bench.whisper --launch --model whisper-large-v3 --results-dir \$OUT"
    g0="timeout 200 $w --server-log \$OUT/whisper.log; timeout 60 python3 notes/tools/pg_decode_probe.py \
--model whisper-large-v3 --batch 1 4 16 --decode-only; $(serve qwen3.5-4b 8004 8 32 64 128)"
    g1="timeout 200 python3 -m mstar.bench.gate --model .gate_model --out \$OUT/gate-trained.json; \
timeout 120 python3 notes/tools/pg_decode_probe.py --model qwen3.5-0.8b --batch 8 32 128 --burst; \
timeout 120 python3 -m pytest -m gpu -q -x tests/test_decode_graphs.py -k whisper"
    run "first:540:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; cd \$OUT && tar czf logs.tgz server-*.log whisper.log \
&& rm -f server-*.log whisper.log; grep -h -v '^INFO' gpu0.log gpu1.log | tail -120"
    ;;
  whisper)  # session 6, call 3 (two H200s, ~8 min): Whisper after the Triton LayerNorm; the capture-order fix
    export PACK_CACHE=1  # bring FlashInfer's head_dim 64 prefill module back (no carried cache has it)
    w="python3 -m mstar.bench.whisper --launch --model whisper-large-v3 --results-dir \$OUT"
    p="python3 notes/tools/pg_decode_probe.py"
    g0="timeout 100 $p --model whisper-large-v3 --batch 1 4 16 --decode-only --kernels 12; \
timeout 280 $w --server-log \$OUT/whisper.log; \
timeout 120 python3 -m pytest -m gpu -q tests/test_gpu_backends.py tests/test_decode_graphs.py -k 'norms or whisper'; \
timeout 150 python3 notes/tools/profile_whisper_step.py --model whisper-large-v3 --rows 1 --clip-seconds 10 --decode-steps 20"
    g1="timeout 120 $p --model qwen3.5-0.8b --batch 8 32 128 --engine-pg --kernels 5; \
timeout 120 $p --model qwen3.5-0.8b --batch 8 --pg-sizes 1 --recapture --kernels 5; $(serve qwen3.5-0.8b 8001 8 32 64 128)"
    run "whisper:570:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; cd \$OUT && tar czf logs.tgz server-*.log whisper.log \
&& rm -f server-*.log whisper.log; grep -h -v '^INFO' gpu0.log gpu1.log | grep -v '^ *[0-9.]* *[0-9.]* *[0-9.]*%' | tail -150"
    ;;
  final)  # session 6, call 4 (two H200s, ~9 min): GPU 0 the gate on the trained checkpoint; GPU 1 the knobs' A/B.
    # Carry .gpu (CuTe xz aside), kernel_cache_slim, .gate_model (no server here: no .whl)
    export KCACHE_DIR=kernel_cache_slim
    off="python3 -m mstar.bench.offline --model qwen3.5-0.8b --random-weights --one-engine --concurrency 8 32 128 \
--out \$OUT/ab.jsonl"
    g1="for k in '' MSTAR_KV_PLAN_CACHE=1 MSTAR_INGRAPH_DECODE_TOKENS=1 \
'MSTAR_INGRAPH_DECODE_TOKENS=1 MSTAR_INGRAPH_DECODE_ROPE=1' MSTAR_KV_PINNED_INDPTRS=1 MSTAR_KV_CHAIN_LAZY_STEPS=8 ''; do \
echo \"== knobs: \$k\"; env \$k timeout 100 $off 2>&1 | grep -v '^INFO'; done; timeout 150 $off --compile decode 2>&1 | grep -v '^INFO'"
    g0="timeout 60 python3 -m pytest -m gpu -q tests/test_gpu_backends.py -k norms; \
timeout 400 python3 -m mstar.bench.gate --model .gate_model --out \$OUT/gate-trained.json; \
timeout 70 python3 notes/tools/pg_decode_probe.py --model qwen3.5-4b --batch 8 --decode-only --kernels 20"
    run "final:560:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & (export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & \
wait; grep -h -v '^INFO' \$OUT/gpu0.log \$OUT/gpu1.log | tail -120"
    ;;
  s7a)  # session 7, call 1 (two H200s, ~8 min): the capture-stream bisect, the engine with the capture fix,
    # the served 4B (GPU 0) and 0.8B (GPU 1). Carry .gpu (CuTe xz aside), kernel_cache_slim, .whl
    export KCACHE_DIR=kernel_cache_slim
    p="python3 notes/tools/pg_decode_probe.py"
    g0="timeout 75 $p --model qwen3.5-0.8b --batch 8 --bisect --bisect-stream default; \
timeout 75 $p --model qwen3.5-0.8b --batch 8 --bisect --bisect-stream same; \
timeout 90 $p --model qwen3.5-0.8b --batch 8 32 128 --engine-pg; $(serve qwen3.5-4b 8004 8 32 64 128)"
    g1="timeout 75 $p --model qwen3.5-4b --batch 8 32 --engine-pg; $(serve qwen3.5-0.8b 8001 8 32 64 128)"
    run "s7a:580:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; cd \$OUT && tar czf logs.tgz server-*.log \
&& rm -f server-*.log; grep -h -v '^INFO' gpu0.log gpu1.log | grep -v '^ *[0-9.]* *[0-9.]* *[0-9.]*%' | tail -150"
    ;;
  s7b)  # session 7, call 2 (two H200s, ~9.5 min): TP2 GPU tests, then 9B at TP2 offline: prefill graphs on,
    # + the symm_mem all-reduce, the default (c8 / c128), phase timing. Carry .gpu, kernel_cache_slim
    export KCACHE_DIR=kernel_cache_slim NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    off="python3 -m mstar.bench.offline --model qwen3.5-9b --random-weights --tp 2 --one-engine --out \$OUT/offline.jsonl"
    run "tptests:110:python3 -m pytest -m gpu -q -x tests/test_tp_allreduce.py tests/test_prefill_graphs.py tests/test_tp.py \
-k 'tp2 or symm or cuda_graphs'" \
        "tp9bpg:140:$off --concurrency 8 32 64 128 --prefill-graphs on" \
        "tp9bsymm:140:MSTAR_TP_ALLREDUCE=symm_mem $off --concurrency 8 32 64 128 --prefill-graphs on" \
        "tp9b:100:$off --concurrency 8 128" \
        "tpphase:60:MSTAR_PHASE_TIMING=1 MSTAR_PHASE_LOG=\$OUT/phase-tp.jsonl $off --concurrency 8 --num-prompts 16 \
--prefill-graphs on --out ''"
    ;;
  s7c)  # session 7, call 3 (two H200s, ~9 min): the pool bisect (GPU 0), the tp=2 graphs test (greedy gather, close),
    # 9B TP2 offline with symm_mem (c8 / c128), the served 9B TP2 row with symm_mem. Carry .gpu, kernel_cache_slim, .whl
    export KCACHE_DIR=kernel_cache_slim NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    off="python3 -m mstar.bench.offline --model qwen3.5-9b --random-weights --tp 2 --one-engine --out \$OUT/offline.jsonl"
    run "pool:75:CUDA_VISIBLE_DEVICES=0 python3 notes/tools/pg_decode_probe.py --model qwen3.5-0.8b --batch 8 --bisect-pool" \
        "tptest:120:python3 -m pytest -m gpu -q -x tests/test_tp.py -k test_tp2_cuda_graphs_match_eager" \
        "tp9bsymm:90:MSTAR_TP_ALLREDUCE=symm_mem $off --concurrency 8 128" \
        "serve9b:250:MSTAR_TP_ALLREDUCE=symm_mem TP=2 $(serve qwen3.5-9b 8009 8 32 64 128); grep 'tp close\|tp=2\|tp rank' \$OUT/server-8009.log"
    ;;
  s7d)  # session 7, call 4 (two H200s, ~6 min): the served 9B TP2 row with symm_mem on a fresh host (call 3's
    # came after a killed test), then the tp=2 graphs test with room to finish. Carry .gpu, kernel_cache_slim, .whl
    export KCACHE_DIR=kernel_cache_slim NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run "serve9b:180:MSTAR_TP_ALLREDUCE=symm_mem TP=2 $(serve qwen3.5-9b 8009 8 32 64 128); grep 'tp close\|tp start-up\|engine start-up' \$OUT/server-8009.log" \
        "tptest:170:python3 -m pytest -m gpu -q -x tests/test_tp.py -k test_tp2_cuda_graphs_match_eager -p no:cacheprovider"
    ;;
  s8a)  # session 8, call 1 (two H200s, ~9 min): the tp=2 GPU tests (graphs released before the group; the
    # vocab-parallel argmax's tokens on NCCL), rank 0's 9B TP2 decode profile, the served 9B TP2 row with the
    # Triton builds logged. Carry .gpu (CuTe xz aside), kernel_cache_in, .whl (~60 MiB); the cache comes back
    export PACK_CACHE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run "tptests:260:python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_tp.py tests/test_tp_allreduce.py \
tests/test_prefill_graphs.py -k 'tp2'" \
        "prof9b:120:python3 notes/tools/profile_step.py --model qwen3.5-9b --tp 2 --rows 8 --decode-graphs auto \
--async-output auto --top 12" \
        "serve9b:180:MSTAR_TP_ALLREDUCE=symm_mem TP=2 $(serve qwen3.5-9b 8009 8 32 64 128); \
grep 'tp close\|start-up\|triton:' \$OUT/server-8009.log | cut -c1-300"
    ;;
  s8b)  # session 8, call 2 (one H200, ~10 min): is the decode slowdown the streams (a graph captured on the decode
    # graphs' own stream vs a fresh one), the engine with its prefill graphs on that stream (since 96bdf6d+), then 0.8B
    # and 4B served with the cache call s8a brought back. Carry .gpu, kernel_cache_in (refreshed), .whl.
    # If the decode-stream graph flips it too: --bisect-count 24 next (a graph count threshold?)
    p="python3 notes/tools/pg_decode_probe.py"
    run "streams:60:$p --model qwen3.5-0.8b --batch 8 --bisect-streams" \
        "enginepg:80:$p --model qwen3.5-0.8b --batch 8 32 128 --engine-pg" \
        "serve08:200:$(serve qwen3.5-0.8b 8001 8 32 64 128); grep 'triton:' \$OUT/server-8001.log | cut -c1-300" \
        "serve4b:240:$(serve qwen3.5-4b 8004 8 32 64 128); grep 'triton:' \$OUT/server-8004.log | cut -c1-300"
    ;;
  s8c)  # session 8, call 2 (two H200s, ~8 min; ran at d2ed8f8: the skinny kernel and gemm_bench were removed after,
    # since cuBLAS was as fast or faster): the decode matmuls, cuBLAS vs the Triton skinny kernel (gemm_bench,
    # then whole steps with MSTAR_BACKENDS=linear=triton); unprofiled prefill steps (profile_step --timed); the
    # s8b probes; the tp=2 prefill-graphs test that hung in s8a, with stacks (faulthandler, SIGUSR1 to the follower)
    export PACK_CACHE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    gb="python3 notes/tools/gemm_bench.py --rows 8"
    pr="python3 notes/tools/profile_step.py --rows 8 --decode-graphs auto --async-output auto --top 8"
    p="python3 notes/tools/pg_decode_probe.py"
    g0="timeout 90 $gb --model qwen3.5-4b; timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider \
tests/test_ops_linear_triton.py tests/test_gpu_backends.py; timeout 100 $pr --model qwen3.5-4b; \
MSTAR_BACKENDS=linear=triton timeout 100 $pr --model qwen3.5-4b"
    g1="timeout 60 $p --model qwen3.5-0.8b --batch 8 --bisect-streams; timeout 80 $p --model qwen3.5-0.8b \
--batch 8 32 128 --engine-pg; timeout 60 $gb --model qwen3.5-0.8b; timeout 60 $gb --model qwen3.5-9b --tp 2; \
timeout 80 $pr --model qwen3.5-0.8b; MSTAR_BACKENDS=linear=triton timeout 80 $pr --model qwen3.5-0.8b"
    run "par:420:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; \
grep -h -v '^INFO\|^ *[a-zA-Z_:<>(), 0-9.]*  *[0-9.]*%' \$OUT/gpu0.log \$OUT/gpu1.log | cut -c1-220 | tail -150" \
        "tp2pg:170:(sleep 130; pkill -USR1 -f spawn_main) & timeout 160 python3 -m pytest -m gpu -q -x -s \
-p no:cacheprovider -o faulthandler_timeout=110 --log-cli-level=INFO tests/test_prefill_graphs.py -k tp2 \
> \$OUT/tp2pg.log 2>&1; tail -c 6000 \$OUT/tp2pg.log"
    ;;
  s8d)  # session 8, call 3 (two H200s, ~9 min): how c8's requests enter steps (admission stats after each level),
    # 4B and 0.8B served, then the idle gather (MSTAR_IDLE_GATHER_US=3000) at c8 / c32 on each; the tp=2
    # prefill-graphs test with stacks (the pattern is bracketed so that pkill does not match this command)
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    g0="$(serve qwen3.5-4b 8004 8 32 64 128); MSTAR_IDLE_GATHER_US=3000 $(serve qwen3.5-4b 8014 8 32)"
    g1="$(serve qwen3.5-0.8b 8001 8 32 64 128); MSTAR_IDLE_GATHER_US=3000 $(serve qwen3.5-0.8b 8011 8 32)"
    run "par:330:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; cat \$OUT/gpu0.log \$OUT/gpu1.log | cut -c1-250; \
cd \$OUT && grep -h 'triton:' server-*.log | cut -c1-200 | tail; tar czf logs.tgz server-*.log && rm -f server-*.log" \
        "tp2pg:170:(sleep 120; pkill -USR1 -f 'spawn_mai[n]') & timeout 160 python3 -m pytest -m gpu -q -x -s \
-p no:cacheprovider -o faulthandler_timeout=100 --log-cli-level=INFO tests/test_prefill_graphs.py -k tp2 \
> \$OUT/tp2pg.log 2>&1; tail -c 5000 \$OUT/tp2pg.log"
    ;;
  s8e)  # session 8, call 4 (two H200s, ~9 min): the fused GDN prefill (one prep launch, fla's grouped chunk kernel
    # called under its wrapper) against the composed ops, unprofiled prefill steps and served; then 9B TP2 served
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    pr="python3 notes/tools/profile_step.py --rows 8 --decode-steps 4 --top 12"
    old="MSTAR_BACKENDS=gdn_prefill_fused=composed"
    g0="timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_backends.py -k gdn; \
timeout 70 $pr --model qwen3.5-4b; $old timeout 70 $pr --model qwen3.5-4b; $(serve qwen3.5-4b 8004 8 32 64 128)"
    g1="timeout 60 $pr --model qwen3.5-0.8b; $old timeout 60 $pr --model qwen3.5-0.8b; \
$(serve qwen3.5-0.8b 8001 8 32 64 128); timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider \
tests/test_prefill_graphs.py tests/test_decode_graphs.py -k 'not tp2 and not whisper'"
    run "par:330:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; \
grep -h '^==\|^   [a-zA-Z]\|passed\|failed\|tok/s\|num_steps\|Error' \$OUT/gpu0.log \$OUT/gpu1.log | cut -c1-220; \
cd \$OUT && tar czf logs.tgz server-*.log && rm -f server-*.log" \
        "serve9b:170:MSTAR_TP_ALLREDUCE=symm_mem TP=2 $(serve qwen3.5-9b 8009 8 32 64 128)"
    ;;
  s8f)  # session 8, call 5 (two H200s, ~5 min): s8e again after the prep kernel's compile fix, without 9B
    export PACK_CACHE=0
    pr="python3 notes/tools/profile_step.py --rows 8 --decode-steps 4 --top 12"
    old="MSTAR_BACKENDS=gdn_prefill_fused=composed"
    g0="timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_backends.py -k gdn; \
timeout 60 $pr --model qwen3.5-4b; $old timeout 60 $pr --model qwen3.5-4b; $(serve qwen3.5-0.8b 8001 8 32)"
    g1="timeout 45 $pr --model qwen3.5-0.8b; $old timeout 45 $pr --model qwen3.5-0.8b; $(serve qwen3.5-4b 8004 8 32 64 128)"
    run "par:265:(export CUDA_VISIBLE_DEVICES=0; $g0) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $g1) > \$OUT/gpu1.log 2>&1 & wait; \
grep -h '^==\|^   [a-zA-Z]\|passed\|failed\|tok/s\|num_steps\|Error' \$OUT/gpu0.log \$OUT/gpu1.log | cut -c1-220; \
cd \$OUT && tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s9a)  # session 9, call 1 (two H200s, ~9 min): the tp=2 tests in one process (the stale-knob hang fixed),
    # the decode and prefill graph tests (their captures now share capture_after_first_use, unrun on a GPU),
    # the fused GDN prefill's GPU check and timing (16 rows per prep program); 4B at c128, each on a fresh server:
    # the default, --admit-max-wait 4, and the bfloat16 recurrent state (MSTAR_GDN_STATE_DTYPE, also at c64)
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    pr="python3 notes/tools/profile_step.py --rows 8 --decode-steps 4 --top 12"
    new="MSTAR_BACKENDS=gdn_prefill_fused=fla"
    run "tests:300:timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tp.py \
tests/test_tp_allreduce.py tests/test_prefill_graphs.py tests/test_gpu_backends.py tests/test_decode_graphs.py \
-k 'tp2 or gdn or (matches_eager and off) or match_the_forward'" \
        "par:270:(export CUDA_VISIBLE_DEVICES=0; timeout 60 $pr --model qwen3.5-4b; $new timeout 60 $pr --model qwen3.5-4b; \
SERVER_ARGS='--admit-max-wait 4' $(serve qwen3.5-4b 8004 128)) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; $(serve qwen3.5-4b 8014 128); MSTAR_GDN_STATE_DTYPE=bfloat16 $(serve qwen3.5-4b 8024 64 128)) \
> \$OUT/gpu1.log 2>&1 & wait; grep -h '^==\|tok/s\|num_steps' \$OUT/gpu0.log \$OUT/gpu1.log | cut -c1-220; \
cd \$OUT && tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s9b)  # session 9, call 3 (two H200s, ~9.5 min): 9B TP2 served with the idle gather (state slots now zeroed
    # with one kernel per stack), then with the bfloat16 recurrent state at c64 / c128; HF transformers at c8 / c32
    # beside a 0.8B server (issue 7 asks for HF in the same run), then 0.8B c8 with an 8 ms gather
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    tp9="MSTAR_IDLE_GATHER_US=3000 MSTAR_TP_ALLREDUCE=symm_mem TP=2"
    run "serve9b:200:$tp9 $(serve qwen3.5-9b 8009 8 32 64 128)" \
        "bf16:150:$tp9 MSTAR_GDN_STATE_DTYPE=bfloat16 $(serve qwen3.5-9b 8019 64 128)" \
        "hf:290:(export CUDA_VISIBLE_DEVICES=0; $(serve qwen3.5-0.8b 8001 1:16 8 32 64 128); \
MSTAR_IDLE_GATHER_US=8000 $(serve qwen3.5-0.8b 8011 8)) > \$OUT/gpu0.log 2>&1 & \
(export CUDA_VISIBLE_DEVICES=1; for c in 8 32; do timeout 120 python3 -m mstar.bench.serve --backend hf \
--model qwen3.5-0.8b --random-weights --concurrency \$c --num-prompts \$c --results-dir \$OUT; done) > \$OUT/gpu1.log 2>&1 & \
wait; grep -h 'tok/s\|num_steps\|rror' \$OUT/gpu0.log \$OUT/gpu1.log | cut -c1-220; \
cd \$OUT && grep -h 'tp=2: rank 0 sent\|tp rank 1:' server-*.log | cut -c1-400; tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s9x4)  # session 9 (four H200s, ~9 min): issue 11, the 27B preset served at TP4 (NCCL all-reduce), c8-c128;
    # a stack dump into the server log at 500 s if it is still running
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run "serve27b:560:(sleep 500; pkill -USR1 -f 'spawn_mai[n]') >/dev/null 2>&1 & TP=4 $(serve qwen3.5-27b 8027 8 32 64 128); \
cd \$OUT && tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s10a)  # session 10, call 1 (two H200s, ~9 min): the fused all-reduce + add + RMSNorm (symm_mem_norm): its bits
    # and time per site against the kernels it replaces, the tp=2 token test, then 9B TP2 served with it
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run "ar:90:timeout 85 python3 notes/tools/allreduce_norm_bench.py --rows 8 32 128 256 && touch \$OUT/ar_ok" \
        "tests:160:[ -f \$OUT/ar_ok ] && python3 -m pytest -m gpu -q -x tests/test_tp_allreduce.py -k symm" \
        "serve9b:250:[ -f \$OUT/ar_ok ] && MSTAR_IDLE_GATHER_US=3000 MSTAR_TP_ALLREDUCE=symm_mem_norm TP=2 \
$(serve qwen3.5-9b 8009 8 32 64 128); cd \$OUT && grep -h 'tp=2: rank 0 sent\|tp rank 1:' server-*.log | cut -c1-400; \
tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s10b)  # session 10, call 2 (two H200s, ~9.5 min): 9B TP2 served with symm_mem_norm after the step buffers' 16-byte
    # alignment (no mid-run Triton variants) and the gather for waiting-only engines (6 ms); the tp=2 token test;
    # the kernel cache comes back (PACK_CACHE=1: the fused kernel's and the 9B conv variants)
    export PACK_CACHE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run "serve9b:270:MSTAR_IDLE_GATHER_US=6000 MSTAR_TP_ALLREDUCE=symm_mem_norm TP=2 \
$(serve qwen3.5-9b 8009 8 32 64 128); cd \$OUT && grep -h 'tp=2: rank 0 sent\|tp rank 1:\|built after' server-*.log \
| cut -c1-300; tar czf logs.tgz server-*.log && rm -f server-*.log" \
        "tests:230:python3 -m pytest -m gpu -q -x tests/test_tp_allreduce.py -k symm 2>&1 | tail -15"
    ;;
  s10c)  # session 10, call 3 (two H200s, ~9 min): the tp=2 token test (one engine per process), stacks at 175 s if
    # it hangs; a second 9B TP2 instance with symm_mem_norm and the 6 ms gather (BENCH.md: two, keep the better)
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run "tests:200:(sleep 175; pkill -USR1 -f 'spawn_mai[n]') >/dev/null 2>&1 & timeout 185 python3 -m pytest -m gpu -x -v \
-o faulthandler_timeout=170 tests/test_tp_allreduce.py -k tp2_symm 2>&1 | tail -40" \
        "serve9b:270:MSTAR_IDLE_GATHER_US=6000 MSTAR_TP_ALLREDUCE=symm_mem_norm TP=2 \
$(serve qwen3.5-9b 8009 8 32 64 128); cd \$OUT && grep -h 'tp=2: rank 0 sent\|tp rank 1:\|built after' server-*.log \
| cut -c1-300; tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s10d)  # session 10, call 4 (two H200s, ~7 min): where a 9B TP2 decode step's time goes with the fused sums
    # (profile, batch 8 and 64), then 9B TP2 served with prefill graphs on (off by default at tp > 1)
    export PACK_CACHE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    p="python3 notes/tools/profile_step.py --model qwen3.5-9b --tp 2 --decode-graphs auto --async-output auto --top 12"
    run "prof:150:MSTAR_TP_ALLREDUCE=symm_mem_norm timeout 140 $p --rows 8 --timed 2 > \$OUT/prof.txt 2>&1; \
grep -A9 'unprofiled\|== prefill step' \$OUT/prof.txt | cut -c1-160; sed -n '/decode steps at/,\$p' \$OUT/prof.txt | head -32 | cut -c1-160" \
        "servepg:270:MSTAR_IDLE_GATHER_US=6000 MSTAR_TP_ALLREDUCE=symm_mem_norm TP=2 SERVER_ARGS='--prefill-graphs on' \
$(serve qwen3.5-9b 8009 8 32 64 128); cd \$OUT && grep -h 'tp=2: rank 0 sent\|tp rank 1:\|built after' server-*.log \
| cut -c1-300; tar czf logs.tgz server-*.log && rm -f server-*.log"
    ;;
  s10e)  # session 10 (one H200, ~3 min): Qwen3.5 on the GPU after the fused in_proj (strided conv / gate inputs):
    # the tiny checkpoint against transformers, the full-size fast backends against the reference, graphs vs eager
    export PACK_CACHE=0
    run "gputests:170:timeout 160 python3 -m pytest -m gpu -q -x tests/test_models_gpu.py tests/test_decode_graphs.py \
-k 'qwen3_5 or (matches_eager and qwen3.5-gpu and off)' 2>&1 | tail -15"
    ;;
  s10g)  # session 10 (one H200, ~5.5 min): 4B served, default configuration, after the fused GDN in_proj and the
    # aligned step buffers (session 9's best of three at 7fa40fb / 21853ad: 2039 / 5985 / 9058 / 11813)
    export PACK_CACHE=0
    run "serve4b:290:$(serve qwen3.5-4b 8004 8 32 64 128); cd \$OUT && grep -h 'built after' server-*.log | cut -c1-200; \
tar czf logs.tgz server-*.log && rm -f server-*.log"
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
    run "tp9bpg:170:$off --concurrency 8 32 128 --prefill-graphs on" \
        "tp9bsymm:150:MSTAR_TP_ALLREDUCE=symm_mem $off --concurrency 8 32 128"
    ;;
  hf)
    run "hf:230:for c in 8 32; do python3 -m mstar.bench.serve --backend hf --model qwen3.5-0.8b --random-weights \
--concurrency \$c --num-prompts \$c --results-dir \$OUT; done"
    ;;
  *)
    sed -n 2,20p "$0"
    exit 2
    ;;
esac
