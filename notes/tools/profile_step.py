"""Where one engine step's time goes, kernel by kernel (torch.profiler).

Builds an engine on a preset with random weights, warms it up, then profiles (a) one prefill
step of --rows prompts of --prompt-len tokens and (b) --decode-steps decode steps, and prints
for each the step's wall time and the top ops by device time and by host time. Answers
"why does a 2048-token prefill step take 450 ms" without guessing.

    python notes/tools/profile_step.py --model qwen3.5-0.8b --rows 8 --prompt-len 256 [--decode-graphs off]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mstar import LLM
from mstar.runtime.request import EngineRequest, SamplingParams


def _requests(n: int, length: int, vocab: int, tag: str, max_tokens: int) -> list[EngineRequest]:
    rng = random.Random(len(tag))
    return [EngineRequest(f"{tag}{i}", [rng.randrange(vocab) for _ in range(length)],
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i in range(n)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _table(prof, key: str, n: int) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=n, max_name_column_width=70)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--rows", type=int, default=8, help="prompts prefilled in the profiled step")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--decode-graphs", default="off", choices=["auto", "off"],
                    help="off (default): decode steps run eagerly, so their ops show in the profile")
    ap.add_argument("--top", type=int, default=25, help="rows per table")
    args = ap.parse_args()

    llm = LLM(args.model, random_weights=True, max_num_seqs=max(args.rows, 8),
              max_model_len=args.prompt_len + args.decode_steps + 64, decode_graphs=args.decode_graphs,
              async_output="off")
    core = llm.engine
    vocab = core.vocab_size
    # warm-up: the same shapes once (first-use compiles and autotuning stay out of the profile)
    for r in _requests(args.rows, args.prompt_len, vocab, "warm", 4):
        core.add_request(r)
    while core.has_unfinished():
        core.step()
    _sync()

    for r in _requests(args.rows, args.prompt_len, vocab, "prof", args.decode_steps + 2):
        core.add_request(r)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    dev_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        core.step()  # the prefill step
        _sync()
        wall = time.perf_counter() - t
    print(f"== prefill step: {args.rows} rows x {args.prompt_len} tokens, {wall * 1e3:.1f} ms wall")
    print(_table(prof, dev_key, args.top))
    print(_table(prof, "self_cpu_time_total", args.top))

    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            core.step()
        _sync()
        wall = time.perf_counter() - t
    print(f"== {args.decode_steps} decode steps at batch {args.rows} (graphs {args.decode_graphs}): "
          f"{wall / args.decode_steps * 1e3:.2f} ms per step")
    print(_table(prof, dev_key, args.top))
    print(_table(prof, "self_cpu_time_total", args.top))
    while core.has_unfinished():
        core.step()
    if hasattr(llm, "close"):
        llm.close()


if __name__ == "__main__":
    main()
