"""`python -m mstar.bench.gate`: the correctness gate. mstar's greedy tokens against
HF transformers' `generate` on the same model, at several batch sizes.

    python -m mstar.bench.gate --model qwen3.5-0.8b --batch-sizes 1 8 32 --out gate.json

The model: a preset's shapes (`--model`, e.g. qwen3.5-0.8b, qwen3-0.6b, tiny-qwen3.5) with
random weights drawn once on the CPU in fp32 from `--seed`, cast to `--dtype` and written by
transformers' save_pretrained to a temp dir with a tokenizer (the byte tokenizer for the tiny
presets, else a synthetic one of the model's vocabulary: byte tokens, then printable-ASCII
fillers, eos specials at the preset's ids). mstar's LLM loads that dir, so both sides run the
same weights. A model directory (an HF checkpoint) is used as it is.

The random init is hf_models.make_hf_model's (tests/hf_models.py: every linear 1/sqrt(fan_in),
norms and GDN parameters spread around their identities) with the embedding at std 0.02
(`--embed-std`): with a tied head and a large embedding the greedy token is the last input
token over and over (the self-logit |e|^2 dominates); a small one makes every token depend
on the whole network.

Per batch size N (`--batch-sizes`): mstar's `LLM.generate` with max_num_seqs = N over all
prompts (`--num-prompts` prompts of random token ids, lengths drawn from `--prompt-len LO HI`,
greedy, `--max-tokens` new tokens, eos ignored), and HF `generate` (do_sample=False, eos
ignored) in batches of N with left padding (`--hf-single`: one prompt at a time, no padding,
the same reference for every N). Reported: full-sequence exact matches, first-token agreement,
mean common-prefix length, wall times of both (after an untimed warm-up of each).

Divergences. Where an mstar output first differs from HF's (position j), a referee judges it:
the same weights (as rounded to --dtype) in fp32 on HF's plain-torch path, run on prompt + the
common prefix. The gap `(max logit - logit of mstar's token) / std of the logits` is recorded
(and HF's own token's, for comparison); a gap <= `--tie-tol` is a near-tie: both tokens equally
good up to rounding. Random-weight models have flat next-token distributions (the top two of
248k logits are often a few hundredths of a std apart) and bf16 rounding moves logits by ~0.1
std, so in bf16 first tokens flip between any two implementations and sequences drift apart
after a flip; that is reported, not a failure. Measured on the CPU at qwen3.5-0.8b in bf16
(24 prompts): HF bf16 picked the fp32 argmax for 19 first tokens, mstar for 17; 22 of 24
outputs diverged from HF's within 6 tokens, all at gaps <= 0.33 (HF's own tokens: <= 0.24).
A real bug picks tokens the referee ranks far down: one perturbed weight in the tiny models
gives gaps of 3.6-4.9. Hence the default tolerance: 1.0 in bf16 (0.5 fp16, 0.01 fp32). Per N
the table also gives how many first tokens of mstar and of HF equal the referee's argmax.

Logprobs. Tokens show only the argmax; on a trained model with wide margins (.gate_model, from
mstar.bench.gate_model: first-token margins >= 13.5 logits) a badly perturbed weight moves the
logits off the argmax by whole units and leaves every greedy token in place. So per N, after
the timed run, mstar runs the prompts again with logprobs=20 for `--logprob-positions` P (4)
tokens: a run of its own (the timed run stays on the plain-greedy path), from an emptied prefix
cache (its first tokens come from a full prefill, as the timed run's did). At output position
0 and each later one < P whose preceding tokens are HF's, mstar's logprobs of its token and of
its top-20 ids are compared with the log_softmax of the referee's fp32 logits of the same
context (next_logits: cached; position 0 is the context first_vs_fp32 already ran, and every
context is shared by the levels); a referee top-20 id absent from mstar's list counts
(referee's - mstar's last listed), a lower bound of its difference. Reported per level (JSON
"logprob"; table column dlp): the largest |difference| (max_diff, with prompt, pos, token, both
values, listed: false where it is such a bound; max_diff_by_pos), and, as the yardstick, HF's
own (hf_max_diff: HF's model in the run dtype, each context alone, at its own tokens against
the same referee; none in fp32 on the CPU, where HF is the referee). The level fails when max_diff > max(`--logprob-tol`,
`--logprob-hf-factor` K x HF's own): floors 0.01 in fp32, 0.25 in bf16, 0.05 in fp16; K 2.5.
Cost on the CPU, .gate_model in bf16, 64 prompts: 32 s at the first N (the referee's and HF's
forwards of positions 1-3, and HF's of position 0), 5-8 s at the others (cached), beside timed
runs of 10-18 s; with P 1 the referee's logits are all first_vs_fp32's.

Measured on the CPU (16 prompts, N 1 and 8, P 4; equal at both N). Unperturbed: fp32 <= 1e-5
on both models. bf16: .gate_model 0.095 (0.098 at 64 prompts, N 1/8/32; HF's own 0.101);
tiny-qwen3.5 0.27 / 0.08 / 0.10 at seeds 0 / 1 / 2 (HF's own 0.30 / 0.23 / 0.09); random
qwen3.5-0.8b 0.29 (8 prompts, HF's own 0.26). fp16: .gate_model 0.011, tiny-qwen3.5 0.009 (HF's
0.012, 0.017). bf16 rounding costs HF as much as mstar: on .gate_model mostly the rounding of
the logits themselves (|logit| ~ 16, bf16 steps of 0.125), on random models the hidden
states'. A fixed bf16 tolerance with headroom over random models' 0.3 (say 0.75) would also
miss .gate_model's final norm and qkv_proj below; hence the floor plus K x HF's own. Not
measured: CUDA (the HF term follows whatever HF's kernels cost there), perturbations in fp16.
Perturbed (--perturb-weight: noise of the weight's own std + 0.1; names as
llm.engine.model.named_parameters() gives them, prefix model.), .gate_model, --strict,
max_diff in fp32 / bf16:
  layers.0.linear_attn.in_proj_qkv 23.6 / 23.6   layers.0.linear_attn.out_proj  18.4 / 18.4
  layers.0.linear_attn.conv1d      17.2 / 17.2   layers.0.mlp.gate_up_proj       4.81 / 4.78
  layers.2.linear_attn.out_proj    4.48 / 4.51   layers.3.mlp.gate_up_proj       4.37 / 4.40
  layers.2.linear_attn.in_proj_zba 2.62 / 2.62   layers.3.mlp.down_proj          2.02 / 1.96
  layers.0.mlp.down_proj           1.37 / 1.40   layers.2.linear_attn.conv1d     1.01 / 0.99
  layers.3.self_attn.o_proj        0.97 / 0.94   layers.0.linear_attn.norm       0.83 / 0.82
  layers.3.self_attn.qkv_proj      0.73 / 0.72   norm (the final one)            0.53 / 0.57
  layers.3.input_layernorm         0.12 / 0.17   layers.1.linear_attn.A_log      0.097 / 0.18
  layers.3.self_attn.q_norm        0.033 / 0.10
(in_proj_qkv and in_proj_zba are one parameter, linear_attn.in_proj, since 8d5ec4f.)
The token check fails only the first (layer 0's in_proj_qkv). With the logprob check the gate
fails all 17 in fp32 (the smallest, q_norm, at 3x the 0.01 floor; noise 1e-5) and 14 in bf16,
all but the last three (tolerance max(0.25, 2.5 x 0.101): 2.3x under the final norm's 0.57,
2.6x over the 0.095 noise). In bf16 it cannot tell layer 3's input_layernorm and q_norm and
layer 1's A_log from rounding: 0.10-0.18, 1-2x the noise. The differences are about the same at
positions 0-3 (position 0 alone catches the same set); the later ones cover the decode path.
tiny-qwen3.5, 11 of these names: fp32 catches all (0.025-0.83, noise 1e-5); bf16 (tolerance
2.5 x 0.30 = 0.74) only layer 0's conv1d and out_proj (0.79, 0.83): the others, 0.27-0.71, are
within 2.5x of HF's own rounding. Its token check fails unperturbed in bf16 already (seed 0: 2
of 14 divergences at gaps 2.3 and 2.7 > 1.0, HF's tokens at 0.0): in bf16 a random tiny model
is no test of either check.

Fixed checks, with the engine of the largest N (prompts already in its prefix cache):
  fixed-8: max_tokens=8, ignore_eos: every output exactly 8 tokens, finish_reason "length",
    equal to HF's first 8 (divergences only at near-ties).
  stop: a stop string (the text of 1-2 tokens of an output where mstar and HF agree) ends the
    output right before its first occurrence (right after with include_stop_str_in_output),
    finish_reason "stop", stop_reason the string, tokens a prefix of the full run's; a stop
    token id (stop_token_ids, one of HF's output tokens) ends it right after its first
    occurrence, the id kept in token_ids and left out of the text.

Exit status 0 when every level and both fixed checks pass, else 1. A level passes when every
output has max_tokens tokens, every divergence is a near-tie and its logprob check passes
(`--logprob-positions 0`: no logprob check); `--strict` instead of the near-ties asks for
complete first-token agreement at every N and fixed-8 equal to HF token for token (use it in
fp32, where no tie is closer than rounding). A compact table is printed; `--out` gets one JSON
object (commit, date, device, dtype, every level's numbers and divergences, the fixed checks).

On a CPU, HF's Qwen3.5 runs its plain-torch functions even where fla / causal_conv1d are
installed (they need a GPU); on CUDA HF uses whatever it finds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import inspect
import itertools
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from mstar.bench.serve import git_commit

DEFAULT_TIE_TOL = {torch.float32: 0.01, torch.bfloat16: 1.0, torch.float16: 0.5}
DEFAULT_LOGPROB_TOL = {torch.float32: 0.01, torch.bfloat16: 0.25, torch.float16: 0.05}
DEFAULT_LOGPROB_HF_FACTOR = 2.5
LOGPROB_TOP = 20  # mstar's top ids per position in the logprob check (SamplingParams.MAX_LOGPROBS)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------
# the model: random weights written as an HF checkpoint, with a tokenizer

def init_random_weights(model, config, seed: int, embed_std: float = 0.02) -> None:
    """tests/hf_models.make_hf_model's init (drawn on the CPU in fp32 from `seed`): every parameter
    random, norm weights too (a zero-centred vs plain norm mix-up shows), A_log / dt_bias in
    their usual ranges; the embedding at `embed_std`."""
    gen = torch.Generator().manual_seed(seed)
    zero_centred = config.model_type.startswith("qwen3_5")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                v = torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                v = torch.randn(p.shape, generator=gen) * 0.5 + 1.0
            elif "norm" in name:  # zero-centred norms around 0, plain / gated around 1
                base = 0.0 if zero_centred and "linear_attn.norm" not in name else 1.0
                v = base + 0.2 * torch.randn(p.shape, generator=gen)
            elif "conv1d" in name:
                v = torch.randn(p.shape, generator=gen) * 0.3
            elif "embed" in name:
                v = torch.randn(p.shape, generator=gen) * embed_std
            else:
                v = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            p.copy_(v)


def synthetic_tokenizer(vocab_size: int, eos_ids: list[int]):
    """A byte-level tokenizer of `vocab_size` ids for random-weight presets without one:
    ids 0..255 one byte each, the eos ids "<|im_end|>" / "<|endoftext|>" (special), every other
    id a filler of 2-3 printable ASCII characters (never produced by encode: no merges; it
    decodes to its characters). Any text round-trips through its UTF-8 bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mstar.models.tokenizer import _byte_to_char
    names = ["<|im_end|>", "<|endoftext|>"] + [f"<|eos_{k}|>" for k in range(2, len(eos_ids))]
    specials = {int(t): names[k] for k, t in enumerate(eos_ids) if 256 <= int(t) < vocab_size}
    chars = _byte_to_char()
    vocab = {ch: i for i, ch in enumerate(chars)}
    printable = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    fillers = ("".join(t) for n in itertools.count(2) for t in itertools.product(printable, repeat=n))
    for i in range(256, vocab_size):
        vocab[specials[i] if i in specials else next(fillers)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials.values()])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    eos = specials.get(int(eos_ids[0])) if eos_ids else None
    pad = specials.get(int(eos_ids[1])) if len(eos_ids) > 1 else eos
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   clean_up_tokenization_spaces=False)


def build_checkpoint(preset_name: str, path: str, dtype: torch.dtype, seed: int, embed_std: float):
    """The HF model of a preset with random weights (drawn on the CPU in fp32, then cast to
    dtype), saved with a tokenizer to `path`. Returns the HF model (on the CPU, eval)."""
    from transformers import AutoModelForCausalLM

    from mstar.models import presets
    preset = presets.get(preset_name)
    if preset is None or preset.model_type not in ("qwen3_5_text", "qwen3"):
        raise SystemExit(f"--model: {preset_name!r} is not a Qwen3.5 / Qwen3 preset or a directory "
                         f"(presets: {', '.join(presets.names())})")
    config = presets.make_config(preset)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_random_weights(model, config, seed, embed_std)
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    if preset.embedded:
        from mstar.models.tokenizer import byte_tokenizer
        tok = byte_tokenizer()
    else:
        eos = config.eos_token_id
        tok = synthetic_tokenizer(config.vocab_size, list(eos) if isinstance(eos, (list, tuple)) else [eos])
    tok.save_pretrained(path)
    return model


_KERNEL_FNS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
               "causal_conv1d_update")


@contextlib.contextmanager
def torch_only_reference(enabled: bool = True):
    """transformers' Qwen3.5 on its plain-torch functions even where fla / causal_conv1d are
    installed (tests/hf_models.py: they need a GPU). Restored on exit."""
    if not enabled:
        yield
        return
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5 as mod
    except ImportError:
        yield
        return
    saved = {n: getattr(mod, n) for n in _KERNEL_FNS if hasattr(mod, n)}
    try:
        for n, f in saved.items():
            setattr(mod, n, inspect.unwrap(f))
        yield
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)


# ---------------------------------------------------------------------------------------
# the HF side: batched greedy reference, and single-sequence logits for the divergence judge

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFReference:
    """`model` generates the reference (HF as it runs in `dtype`); `referee` judges divergences:
    the same weights in fp32 on HF's plain-torch path (the model itself in fp32)."""

    def __init__(self, model, referee, device: torch.device):
        self.model = model
        self.referee = referee
        self.device = device
        self.cpu = device.type == "cpu"
        cfg = model.config
        eos = cfg.eos_token_id
        pad = getattr(cfg, "pad_token_id", None)
        if pad is None:
            pad = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) or 0
        self.pad = int(pad)
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._own: dict[tuple[int, ...], Any] = {}

    def generate(self, prompts: list[list[int]], max_new: int, batch: int) -> tuple[list[list[int]], float]:
        """Greedy outputs (eos ignored) in batches of `batch` prompts, left-padded; wall seconds."""
        outs: list[list[int]] = []
        wall = 0.0
        for b in range(0, len(prompts), batch):
            chunk = prompts[b:b + batch]
            L = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), L), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for r, p in enumerate(chunk):
                ids[r, L - len(p):] = torch.tensor(p)
                mask[r, L - len(p):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            _sync(self.device)
            t0 = time.perf_counter()
            with torch.inference_mode(), torch_only_reference(self.cpu):
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                          do_sample=False, eos_token_id=None, pad_token_id=self.pad)
            _sync(self.device)
            wall += time.perf_counter() - t0
            new = out[:, L:].tolist()
            if any(len(x) != max_new for x in new):
                raise RuntimeError(f"HF generate returned {out.shape[1] - L} new tokens, asked for {max_new}")
            outs += new
        return outs, wall

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """The referee's logits (float32, on the CPU) of the token after `ids`, the sequence alone."""
        key = tuple(ids)
        if key not in self._logits:
            with torch.inference_mode(), torch_only_reference(True):
                x = torch.tensor([ids], device=self.device)
                self._logits[key] = self.referee(input_ids=x).logits[0, -1].float().cpu()
        return self._logits[key]

    def own_logprobs(self, ids: list[int], token: int, top: int):
        """HF's own logprobs after `ids` (the sequence alone; the model in the run dtype, on the
        path its generate takes) as mstar reports them: TokenLogprobs of `token` and the top
        `top`. The logprob check's yardstick: how far HF itself is from the referee."""
        from mstar.runtime.engine.request import TokenLogprobs
        key = (*ids, -1, token, top)
        if key not in self._own:
            with torch.inference_mode(), torch_only_reference(self.cpu):
                x = torch.tensor([ids], device=self.device)
                lp = torch.log_softmax(self.model(input_ids=x).logits[0, -1].float(), dim=-1).cpu()
            v, i = torch.topk(lp, min(top, lp.numel()))
            self._own[key] = TokenLogprobs(float(lp[token]), i.tolist(), v.tolist())
        return self._own[key]

    def gap(self, ids: list[int], token: int) -> float:
        """(max logit - logit of `token`) / std of the logits, after `ids`, by the referee: 0
        for its own choice, hundredths for a near-tie, whole units for a token it ranks far down."""
        lg = self.next_logits(ids)
        return float((lg.max() - lg[token]) / lg.std().clamp_min(1e-12))


# ---------------------------------------------------------------------------------------
# comparison

def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(prompts: list[list[int]], got: list[list[int]], ref: list[list[int]], hf: HFReference,
            tie_tol: float, want_len: int) -> dict[str, Any]:
    """Agreement of `got` (mstar) with `ref` (HF); each divergence judged by the referee (gap of
    mstar's token, and of HF's for comparison)."""
    exact = first = first_ties = 0
    prefixes, divs, short = [], [], []
    for i, (p, g, r) in enumerate(zip(prompts, got, ref)):
        cp = common_prefix(g, r)
        prefixes.append(cp)
        if len(g) != want_len:
            short.append({"prompt": i, "len": len(g)})
        if cp == len(g) == len(r):
            exact += 1
        if g and r and g[0] == r[0]:
            first += 1
        if cp < min(len(g), len(r)):
            ctx = p + r[:cp]
            gap = hf.gap(ctx, g[cp])
            tie = gap <= tie_tol
            divs.append({"prompt": i, "pos": cp, "hf": r[cp], "mstar": g[cp], "gap": round(gap, 4),
                         "hf_gap": round(hf.gap(ctx, r[cp]), 4), "near_tie": tie})
            if cp == 0 and tie:
                first_ties += 1
    gaps = [d["gap"] for d in divs]
    hf_gaps = [d["hf_gap"] for d in divs]
    return {"num_prompts": len(prompts), "exact_match": exact, "first_token_agree": first,
            "first_token_agree_with_ties": first + first_ties,
            "mean_common_prefix": round(sum(prefixes) / max(len(prefixes), 1), 3),
            "diverged": len(divs), "near_ties": sum(d["near_tie"] for d in divs),
            "max_gap": max(gaps) if gaps else None, "max_hf_gap": max(hf_gaps) if hf_gaps else None,
            "wrong_length": short, "divergences": divs}


def first_vs_referee(prompts: list[list[int]], outs: list[list[int]], hf: HFReference) -> dict[str, Any]:
    """How often `outs`' first tokens are the referee's (fp32) argmax, and the largest gap: the
    same yardstick for mstar and for HF in the run dtype."""
    gaps = [hf.gap(p, o[0]) for p, o in zip(prompts, outs) if o]
    return {"agree": sum(g == 0.0 for g in gaps), "max_gap": round(max(gaps), 4) if gaps else None}


def logprob_check(prompts: list[list[int]], toks: list[list[int]], lps: list[list[Any]], ref: list[list[int]],
                  hf: HFReference, positions: int, tol: float) -> dict[str, Any]:
    """mstar's logprobs against the fp32 referee's log_softmax at the same token ids.

    toks[i] / lps[i]: the tokens of prompt i and their TokenLogprobs (the token's logprob,
    top_ids / top_logprobs), mstar's (or HF's own, for the yardstick). Checked: output positions j < `positions` while the
    tokens before j are HF's (ref[i][:j]: the same contexts the divergence judge uses; position
    0 always), each against hf.next_logits(prompt + tokens[:j]) (cached, shared by the levels).
    Per position the difference is the largest |mstar - referee| over the token and mstar's
    top ids; a referee top id that mstar leaves out of its list (it puts it at or below its
    last listed logprob) adds referee - last listed, a lower bound of its difference. Returns
    the largest difference, where it is, and pass (<= tol)."""
    worst: dict[str, Any] = {"max_diff": 0.0}
    checked = 0
    by_pos = [0.0] * positions

    def note(d: float, i: int, j: int, tid: int, got: float, want: float, listed: bool) -> None:
        nonlocal worst
        by_pos[j] = max(by_pos[j], d)
        if d > worst["max_diff"]:
            worst = {"max_diff": d, "prompt": i, "pos": j, "token": tid, "mstar": got, "referee": want,
                     "listed": listed}

    for i, (p, t, lp, r) in enumerate(zip(prompts, toks, lps, ref)):
        for j in range(min(positions, len(t), len(lp or []))):
            if t[:j] != r[:j]:
                break
            ref_lp = torch.log_softmax(hf.next_logits(p + t[:j]).double(), dim=-1)
            e = lp[j]
            ids = [t[j], *e.top_ids]
            vals = [e.logprob, *e.top_logprobs]
            checked += 1
            for tid, v in zip(ids, vals):
                note(abs(v - float(ref_lp[tid])), i, j, tid, v, float(ref_lp[tid]), True)
            if e.top_ids and len(e.top_ids) < ref_lp.numel():
                floor = min(e.top_logprobs)
                listed = set(e.top_ids)
                top_ref = torch.topk(ref_lp, len(e.top_ids))
                for rv, tid in zip(top_ref.values.tolist(), top_ref.indices.tolist()):
                    if tid not in listed:
                        note(rv - floor, i, j, tid, floor, rv, False)
    for k in ("max_diff", "mstar", "referee"):
        if k in worst:
            worst[k] = round(worst[k], 6)
    return {**worst, "max_diff_by_pos": [round(d, 6) for d in by_pos], "checked": checked, "positions": positions,
            "tol": tol, "pass": checked > 0 and worst["max_diff"] <= tol}


def hf_logprob_diff(prompts: list[list[int]], ref: list[list[int]], hf: HFReference, positions: int) -> float | None:
    """HF's own largest difference from the referee: logprob_check on HF's tokens with HF's
    logprobs in the run dtype (hf.own_logprobs, each sequence alone). None where HF is the
    referee (fp32 on the CPU: the same computation)."""
    if hf.model is hf.referee and hf.cpu:
        return None
    toks = [r[:positions] for r in ref]
    lps = [[hf.own_logprobs(p + t[:j], t[j], LOGPROB_TOP) for j in range(len(t))] for p, t in zip(prompts, toks)]
    return logprob_check(prompts, toks, lps, ref, hf, positions, math.inf)["max_diff"]


def check_logprobs(llm, prompts: list[list[int]], ref: list[list[int]], hf: HFReference, positions: int,
                   tol: float, hf_factor: float) -> dict[str, Any]:
    """One level's logprob check. mstar's greedy run of `positions` tokens with logprobs=LOGPROB_TOP
    (a run of its own, so the timed run stays on the plain-greedy path; from an empty prefix
    cache, so its first tokens come from a full prefill as the timed run's did), judged by
    logprob_check against the tolerance max(tol, hf_factor * HF's own difference)."""
    from mstar import SamplingParams
    reset = getattr(llm.engine, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    outs = llm.generate(prompts, SamplingParams(max_tokens=positions, temperature=0.0, ignore_eos=True,
                                                logprobs=LOGPROB_TOP))
    hf_diff = hf_logprob_diff(prompts, ref, hf, positions)
    eff = tol if hf_diff is None else max(tol, round(hf_factor * hf_diff, 6))
    res = logprob_check(prompts, [list(o.token_ids) for o in outs], [o.logprobs for o in outs], ref, hf, positions,
                        eff)
    res.update(hf_max_diff=hf_diff, tol_floor=tol, hf_factor=hf_factor)
    return res


def _level_pass(c: dict[str, Any], strict: bool) -> bool:
    if c["wrong_length"]:
        return False
    if strict:
        return c["first_token_agree"] == c["num_prompts"]
    return c["near_ties"] == c["diverged"]


# ---------------------------------------------------------------------------------------
# the fixed checks

def check_fixed8(llm, prompts, ref8, hf, tie_tol, strict) -> dict[str, Any]:
    from mstar import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    got = [list(o.token_ids) for o in outs]
    c = compare(prompts, got, ref8, hf, tie_tol, 8)
    c["all_len_8"] = all(len(g) == 8 for g in got) and all(o.finish_reason == "length" for o in outs)
    c["pass"] = c["all_len_8"] and (c["exact_match"] == len(prompts) if strict else c["near_ties"] == c["diverged"])
    return c


def _stop_candidates(tok, ref: list[int], agree: int):
    """(start, length, text) of 1-2 token windows inside the agreeing prefix whose text is
    printable ASCII without surrounding spaces: stop strings that detokenize unambiguously."""
    for k in (2, 1):
        for s in range(1, agree - k + 1):
            text = tok.decode(ref[s:s + k], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if text and text.isascii() and text.isprintable() and text == text.strip():
                yield s, k, text


def _alone(llm, prompt: list[int], params):
    """One request alone, with the prefix cache emptied first: reruns of the same prompt then
    repeat the same computation (with cached pages, a rerun's numerics and so its near-tie
    tokens in bf16 can differ from the run that filled the cache)."""
    reset = getattr(llm.engine, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    (r,) = llm.generate([prompt], params)
    return r


def check_stops(llm, prompts, main_outs, ref, max_tokens: int, tries: int = 8) -> dict[str, Any]:
    """Stop string and stop token taken from HF's output. Per candidate prompt (those whose
    mstar output agrees longest with HF's first) a baseline run alone without stops; the stop
    is taken where the baseline agrees with HF, and the runs with it are compared with the
    baseline."""
    from mstar import SamplingParams
    tok = llm.tokenizer
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    order = sorted(range(len(prompts)), key=lambda i: -common_prefix(main_outs[i].token_ids, ref[i]))[:tries]
    res: dict[str, Any] = {}
    pick = tpick = None
    for i in order:
        base = _alone(llm, prompts[i], greedy)
        agree = common_prefix(base.token_ids, ref[i])
        if tpick is None and agree >= 1:
            tpick = (i, base, agree)
        if tok is not None:
            for s, k, text in _stop_candidates(tok, ref[i], agree):
                if text in base.text:
                    pick = (i, base, s, k, text)
                    break
        if pick is not None and tpick is not None:
            break

    # stop string: output cut right before its first occurrence (after it with include_stop_str_in_output)
    if pick is None:
        res["stop_string"] = {"pass": False, "error": "no stop-string candidate where mstar agrees with HF"
                                                      + ("" if tok is not None else " (no tokenizer)")}
    else:
        i, base, s, k, stop = pick
        cut = base.text.index(stop)
        runs, ok = [], True
        for include in (False, True):
            p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                               stop=[stop, "\x00never\x00"], include_stop_str_in_output=include)
            r = _alone(llm, prompts[i], p)
            want_text = base.text[:cut + len(stop)] if include else base.text[:cut]
            n = len(r.token_ids)
            checks = {"finish_stop": r.finish_reason == "stop", "stop_reason": r.stop_reason == stop,
                      "text": r.text == want_text, "tokens_prefix_of_hf": list(r.token_ids) == ref[i][:n],
                      "stopped_in_time": 1 <= n <= s + k}
            ok = ok and all(checks.values())
            runs.append({"include_stop_str": include, "tokens": n, "finish_reason": r.finish_reason,
                         "text_len": len(r.text), "want_text_len": len(want_text), **checks})
        res["stop_string"] = {"prompt": i, "stop": stop, "window": [s, s + k], "runs": runs, "pass": ok}

    # stop token: the output ends right after the first occurrence of one of HF's tokens
    if tpick is None:
        res["stop_token"] = {"pass": False, "error": "no mstar output agrees with HF on its first token"}
    else:
        i, base, agree = tpick
        j = min(3, agree - 1)
        t = ref[i][j]
        j0 = ref[i].index(t)
        r = _alone(llm, prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[t]))
        checks = {"finish_stop": r.finish_reason == "stop", "stop_reason": r.stop_reason == t,
                  "tokens": list(r.token_ids) == ref[i][:j0 + 1], "text_prefix": base.text.startswith(r.text)}
        res["stop_token"] = {"prompt": i, "token": t, "want_tokens": j0 + 1, "got_tokens": len(r.token_ids),
                             **checks, "pass": all(checks.values())}
    res["pass"] = res["stop_string"]["pass"] and res["stop_token"]["pass"]
    return res


# ---------------------------------------------------------------------------------------
# driver

def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu ({platform.machine()})"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def perturb(llm, name: str, seed: int) -> None:
    """Self-test: add noise of the weight's own spread to one mstar weight (the gate must fail)."""
    params = dict(llm.engine.model.named_parameters())
    if name not in params:
        raise SystemExit(f"--perturb-weight: no mstar weight {name!r} (e.g. {next(iter(params))})")
    p = params[name]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        noise = torch.randn(p.shape, generator=g) * (p.float().std().item() + 0.1)
        p.add_(noise.to(device=p.device, dtype=p.dtype))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mstar.bench.gate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b",
                    help="Qwen3.5 / Qwen3 preset (random weights) or an HF checkpoint directory")
    ap.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--device", default="auto", help="auto (cuda if there is one), cuda, cuda:N or cpu")
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts of random token ids")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"),
                    help="prompt lengths drawn uniformly from [LO, HI] (random token ids)")
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (eos ignored)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32],
                    help="N: mstar's max_num_seqs and HF's batch size")
    ap.add_argument("--hf-single", action="store_true",
                    help="HF one prompt at a time (no padding), one reference for every N")
    ap.add_argument("--tie-tol", type=float, default=None,
                    help="largest gap (stds of the fp32 referee's logits) of a near-tie; default "
                         "1.0 in bf16, 0.5 in fp16, 0.01 in fp32")
    ap.add_argument("--logprob-tol", type=float, default=None,
                    help="logprob check: the floor of the tolerance on |mstar's logprob - the fp32 referee's| "
                         "(nats) at mstar's token and top-20 ids; default 0.25 in bf16, 0.05 in fp16, 0.01 in fp32")
    ap.add_argument("--logprob-hf-factor", type=float, default=DEFAULT_LOGPROB_HF_FACTOR, metavar="K",
                    help="logprob check: the tolerance is max(--logprob-tol, K x HF's own largest difference "
                         "from the referee); 0: --logprob-tol alone (default 2.5)")
    ap.add_argument("--logprob-positions", type=int, default=4, metavar="P",
                    help="logprob check: output positions per prompt (the first always; the later ones while "
                         "mstar's tokens are HF's); 0: no logprob check")
    ap.add_argument("--strict", action="store_true",
                    help="pass only with complete first-token agreement and fixed-8 equal to HF")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    ap.add_argument("--embed-std", type=float, default=0.02, help="std of the random embedding")
    ap.add_argument("--cache-gib", type=float, default=16.0,
                    help="KV / state cache memory of mstar's engine on CUDA (GiB); the CPU uses the default")
    ap.add_argument("--perturb-weight", default=None, metavar="NAME",
                    help="self-test: add noise to this mstar weight after loading (the gate must fail)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    lo, hi = args.prompt_len
    if not 1 <= lo <= hi:
        ap.error("--prompt-len: need 1 <= LO <= HI")
    if args.num_prompts < 1 or args.max_tokens < 1 or min(args.batch_sizes) < 1:
        ap.error("--num-prompts, --max-tokens and --batch-sizes must be positive")
    if args.logprob_positions < 0 or args.logprob_hf_factor < 0:
        ap.error("--logprob-positions and --logprob-hf-factor must be >= 0")
    return args


def _guard(fn, *args) -> dict[str, Any]:
    """A fixed check's result, or its error as a failed result."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {"pass": False, "error": f"{type(e).__name__}: {e}"}


def _fmt_gap(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def run(args) -> dict[str, Any]:
    from mstar import LLM, SamplingParams

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = _DTYPES[args.dtype]  # parse_args checked the name
    dtype_name = str(dtype).removeprefix("torch.")
    tie_tol = DEFAULT_TIE_TOL.get(dtype, 0.5) if args.tie_tol is None else args.tie_tol
    lp_tol = DEFAULT_LOGPROB_TOL.get(dtype, 0.25) if args.logprob_tol is None else args.logprob_tol
    lp_pos = args.logprob_positions
    sizes = list(args.batch_sizes)
    T = args.max_tokens
    lo, hi = args.prompt_len

    tmp = None
    t_setup = time.perf_counter()
    if os.path.isdir(args.model):
        from transformers import AutoModelForCausalLM
        path = args.model
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    else:
        tmp = tempfile.mkdtemp(prefix="mstar-gate-")
        path = tmp
        hf_model = build_checkpoint(args.model, path, dtype, args.seed, args.embed_std)
    try:
        hf_model = hf_model.to(device)
        # the referee: the same (rounded) weights in fp32
        referee = hf_model if dtype == torch.float32 else copy.deepcopy(hf_model).float()
        hf = HFReference(hf_model, referee, device)
        vocab = int(hf_model.config.vocab_size)
        prompts = make_prompts(args.num_prompts, lo, hi, vocab, args.seed)
        warm = make_prompts(max(sizes), lo, hi, vocab, args.seed + 1)
        setup_s = time.perf_counter() - t_setup
        print(f"gate: {args.model} {dtype_name} on {_device_name(device)}; {len(prompts)} prompts of "
              f"{lo}..{hi} tokens, {T} new tokens, N = {sizes} (setup {setup_s:.1f} s)", flush=True)

        # HF references (before any engine takes its share of device memory)
        refs: dict[int, tuple[list[list[int]], float]] = {}
        for n in ([1] if args.hf_single else sizes):
            t0 = time.perf_counter()
            hf.generate(warm[:n], 2, n)  # warm-up: first-use compiles / autotuning
            refs[n] = hf.generate(prompts, T, n)
            print(f"  HF batch {n}: {refs[n][1]:.1f} s (+{time.perf_counter() - t0 - refs[n][1]:.1f} s warm-up)",
                  flush=True)
        if args.hf_single:
            refs = {n: refs[1] for n in sizes}
        n_fix = max(sizes)
        ref8 = [r[:8] for r in refs[n_fix][0]] if T >= 8 else hf.generate(prompts, 8, 1 if args.hf_single else n_fix)[0]

        gen = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
        levels, fixed8, stops = [], None, None
        import mstar.ops
        backends = {e.name: e.selected(device.type) for e in mstar.ops.all_ops()}
        for n in sizes:
            opts: dict[str, Any] = {"dtype": dtype_name, "device": str(device), "max_num_seqs": n,
                                    "max_model_len": hi + max(T, 8) + 8, "seed": args.seed}
            if device.type == "cuda":
                opts["cache_memory_bytes"] = int(args.cache_gib * 2 ** 30)
            t_llm = time.perf_counter()
            llm = None
            try:
                llm = LLM(path, **opts)
                if args.perturb_weight:
                    perturb(llm, args.perturb_weight, args.seed)
                llm.generate(warm[:n], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
                _sync(device)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, gen)
                _sync(device)
                wall = time.perf_counter() - t0
                got = [list(o.token_ids) for o in outs]
                ref, hf_wall = refs[n]
                c = compare(prompts, got, ref, hf, tie_tol, T)
                c["first_vs_fp32"] = {"mstar": first_vs_referee(prompts, got, hf),
                                      "hf": first_vs_referee(prompts, ref, hf)}
                c.update(n=n, mstar_wall_s=round(wall, 3), hf_wall_s=round(hf_wall, 3),
                         hf_batch=1 if args.hf_single else n,
                         finish_length=sum(o.finish_reason == "length" for o in outs))
                lp_note = ""
                if lp_pos:
                    t1 = time.perf_counter()
                    lp = c["logprob"] = check_logprobs(llm, prompts, ref, hf, lp_pos, lp_tol, args.logprob_hf_factor)
                    lp_note = (f"; logprob check {time.perf_counter() - t1:.1f} s: max |diff| {lp['max_diff']:.3g} "
                               f"(HF's own {_fmt_gap(lp['hf_max_diff'], '.3g')}, tol {lp['tol']:.3g}) over "
                               f"{lp['checked']} positions")
                c["pass"] = (_level_pass(c, args.strict) and c["finish_length"] == len(prompts)
                             and c.get("logprob", {"pass": True})["pass"])
                levels.append(c)
                print(f"  mstar N={n}: {wall:.1f} s (engine + warm-up {t0 - t_llm:.1f} s); exact {c['exact_match']}, "
                      f"first token {c['first_token_agree']}, diverged {c['diverged']} "
                      f"({c['near_ties']} near-ties){lp_note}", flush=True)
                if n == n_fix:
                    fixed8 = _guard(check_fixed8, llm, prompts, ref8, hf, tie_tol, args.strict)
                    stops = _guard(check_stops, llm, prompts, outs, ref, T)
            except Exception as e:  # noqa: BLE001 -- recorded; the other levels still run
                traceback.print_exc()
                levels.append({"n": n, "error": f"{type(e).__name__}: {e}", "pass": False})
            finally:
                if llm is not None:
                    llm.close()
                llm = None
                _free(device)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    if fixed8 is None:
        fixed8 = {"pass": False, "error": f"not run (the N={n_fix} level failed)"}
    if stops is None:
        stops = {"pass": False, "error": f"not run (the N={n_fix} level failed)"}
    ok = all(lv["pass"] for lv in levels) and fixed8["pass"] and stops["pass"]
    result = {
        "bench": "gate", "model": args.model, "dtype": dtype_name, "device": str(device),
        "gpu": _device_name(device), "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "num_prompts": len(prompts), "prompt_len": [lo, hi], "max_tokens": T, "batch_sizes": sizes,
        "seed": args.seed, "embed_std": args.embed_std, "hf_single": args.hf_single, "tie_tol": tie_tol,
        "logprob_tol": lp_tol, "logprob_hf_factor": args.logprob_hf_factor, "logprob_positions": lp_pos,
        "logprob_top": LOGPROB_TOP,
        "strict": args.strict, "perturb_weight": args.perturb_weight, "setup_s": round(setup_s, 1),
        "levels": levels, "fixed_8": fixed8, "stop": stops, "backends": backends, "pass": ok,
    }
    return result


def _print_far(c: dict[str, Any], tol: float, tag: str = "") -> None:
    """The divergences beyond the tolerance (at most 5), worst first."""
    far = sorted((d for d in c["divergences"] if not d["near_tie"]), key=lambda d: -d["gap"])
    for d in far[:5]:
        print(f"     {tag}prompt {d['prompt']} pos {d['pos']}: mstar {d['mstar']} / HF {d['hf']}, gap {d['gap']:.3f} "
              f"> {tol} (HF's token: {d['hf_gap']:.3f})")


def _fmt_dlp(lp) -> str:
    return "-" if lp is None else f"{lp['max_diff']:.3g}/{_fmt_gap(lp['hf_max_diff'], '.3g')}"


def _print_logprob(lp) -> None:
    """Where the logprob check's largest difference is, when it fails."""
    if lp is None or lp["pass"]:
        return
    if not lp["checked"]:
        print("     logprob: no logprobs came back from mstar")
        return
    how = "" if lp["listed"] else " (a referee top id left out of mstar's list: bound from its last listed)"
    print(f"     logprob: prompt {lp['prompt']} pos {lp['pos']} token {lp['token']}: mstar {lp['mstar']:.4f} / "
          f"fp32 {lp['referee']:.4f}, |diff| {lp['max_diff']:.4f} > tol {lp['tol']:.4g} (HF's own largest "
          f"|diff| {_fmt_gap(lp['hf_max_diff'], '.3g')}){how}")


def _fmt_lp_tol(res: dict[str, Any]) -> str:
    if not res["logprob_positions"]:
        return "off"
    k = res["logprob_hf_factor"]
    return f"max({res['logprob_tol']}, {k} x HF's)" if k else f"{res['logprob_tol']}"


def print_table(res: dict[str, Any]) -> None:
    P = res["num_prompts"]
    print("exact: whole output = HF's; first-tok: first token = HF's (+ties: or a near-tie); prefix: mean "
          "common prefix; diverged / ties / max gap: where outputs part, how many are near-ties, the largest "
          "gap (stds of the fp32 referee's logits); =fp32: first tokens equal to the fp32 referee's argmax, "
          "mstar / HF; dlp: the logprob check's largest |logprob - fp32 referee's|, mstar / HF's own (- : HF is the "
          "referee)")
    print(f"{'N':>4} {'exact':>7} {'first-tok':>9} {'+ties':>6} {'prefix':>7} {'diverged':>8} {'ties':>5} "
          f"{'max gap':>8} {'=fp32 ms/hf':>12} {'dlp ms/hf':>15} {'mstar s':>8} {'hf s':>7}  pass")
    for lv in res["levels"]:
        if "error" in lv:
            print(f"{lv['n']:>4} error: {lv['error']}  FAIL")
            continue
        fr = lv["first_vs_fp32"]
        print(f"{lv['n']:>4} {lv['exact_match']:>3}/{P:<3} {lv['first_token_agree']:>5}/{P:<3} "
              f"{lv['first_token_agree_with_ties']:>6} {lv['mean_common_prefix']:>7.2f} {lv['diverged']:>8} "
              f"{lv['near_ties']:>5} {_fmt_gap(lv['max_gap']):>8} {fr['mstar']['agree']:>6}/{fr['hf']['agree']:<5} "
              f"{_fmt_dlp(lv.get('logprob')):>15} {lv['mstar_wall_s']:>8.2f} {lv['hf_wall_s']:>7.2f}  "
              f"{'ok' if lv['pass'] else 'FAIL'}")
        if lv["wrong_length"]:
            print(f"     wrong output lengths: {lv['wrong_length'][:8]}")
        _print_far(lv, res["tie_tol"])
        _print_logprob(lv.get("logprob"))
    f8 = res["fixed_8"]
    if "error" in f8:
        print(f"fixed-8: {f8['error']}  FAIL")
    else:
        _print_far(f8, res["tie_tol"], "fixed-8 ")
        print(f"fixed-8: all 8 tokens {'yes' if f8['all_len_8'] else 'NO'}; equal to HF {f8['exact_match']}/{P} "
              f"(diverged {f8['diverged']}, near-ties {f8['near_ties']}, max gap {_fmt_gap(f8['max_gap'])})  "
              f"{'ok' if f8['pass'] else 'FAIL'}")
    st = res["stop"]
    ss, tk = st.get("stop_string", st), st.get("stop_token", st)
    if "error" in ss:
        print(f"stop string: {ss['error']}  FAIL")
    else:
        print(f"stop string {ss['stop']!r} (prompt {ss['prompt']}): "
              + "; ".join(f"include={r['include_stop_str']}: {r['tokens']} tok, {r['finish_reason']}" for r in ss["runs"])
              + f"  {'ok' if ss['pass'] else 'FAIL'}")
    if "error" in tk:
        print(f"stop token: {tk['error']}  FAIL")
    else:
        print(f"stop token {tk['token']} (prompt {tk['prompt']}): {tk['got_tokens']} tokens "
              f"(want {tk['want_tokens']})  {'ok' if tk['pass'] else 'FAIL'}")
    print(f"GATE {'PASS' if res['pass'] else 'FAIL'}  ({res['dtype']}, tie tol {res['tie_tol']} std, "
          f"logprob tol {_fmt_lp_tol(res)}"
          f"{', strict' if res['strict'] else ''}; commit {res['commit']})", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
