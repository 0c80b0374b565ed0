"""`python -m mstar.bench.gate_model`: a small *trained* Qwen3.5 checkpoint for the correctness gate.

    python -m mstar.bench.gate_model --out .gate_model
    python -m mstar.bench.gate --model .gate_model --device cpu --dtype float32 --strict

Why. With random weights the next-token distribution is nearly flat, so in bf16 the first
tokens of any two implementations disagree at near-ties (mstar.bench.gate's docstring). The
gate can only demand complete first-token agreement of a model whose predictions are
confident, and no model hub is reachable: this module makes one.

The model: transformers' Qwen3_5ForCausalLM (model_type qwen3_5_text, the class mstar's loader
reads from a checkpoint directory) with the per-head shapes of the qwen3.5-0.8b preset
(attention: 8 query heads, 2 KV heads, head_dim 256, partial rotary 0.25, the preset's rope;
GDN: 16 key and 16 value heads of 128, conv kernel 4, so conv width 6144) and a full-attention
layer every 4th, in a small model (default: hidden 256, MLP 512, 4 layers = 3 GDN + 1 full
attention, vocab 1024, LM head tied to the embedding as in the 0.8B; the hidden and MLP sizes
of the tests' qwen3.5-gpu kind), so that the FlashInfer / fla / norm kernels built for the
preset and for those tests are reused on the GPU. 11.6 M parameters: 22 MiB saved in bf16
(`--save-dtype`).

The task (a deterministic function of the context), with a lag k (`--lag`, default 3):

    next(t_0 .. t_{n-1}) = perm[t_{n-k}]        (defined for n >= k)

`--rule copy` (default): perm is the identity, so after any prompt of uniformly random ids (the
gate's prompts) the greedy continuation cycles through the prompt's last k tokens (period 3: not
one repeated token). Reading t_{n-k} takes the GDN path (short convolution, delta rule, gated
norm) or attention; the tied head then makes the copied embedding the top logit. `--rule perm`:
a random derangement of the vocabulary drawn from `--seed` (continuations that never repeat a
token; best with `--untied`); it has to learn a map of the whole vocabulary and learns far
slower (not reached in the default budget).

Training data: sequences of `--min-len`..`--max-len` tokens (one length per step, about
`--tokens-per-step` tokens per batch); each row is uniformly random ids up to a random cut,
then follows the rule. The label of EVERY position n >= k is next(context), also inside the
random part: so the model learns the rule on contexts that do not follow it (the gate's
prompts) as well as on its own continuations. Plain torch AdamW (warmup, cosine decay to 10%;
the GDN short-convolution weights at `--conv-lr-mult` times the rate: their init, uniform in
+-0.5, is far from a shift by k at 2e-3 a step, and at 1x the loss sat at ln(vocab) for
150-350 steps, at 10x ~200 steps in each of seeds 0-2), on the CPU, `--threads` intra-op
threads; deterministic for a seed and thread count. Small batches, many steps: at the
defaults ~0.32 s a step on 2 idle CPU cores, 1200 steps in ~6.5 minutes; the loss falls
from ln(vocab) after ~200-300 steps and reaches ~0.01.

Then the model is cast to `--save-dtype`, saved with save_pretrained (safetensors) into
`--out` with a byte-level tokenizer of the vocabulary (mstar.bench.gate.synthetic_tokenizer:
the gate's stop-string check decodes tokens) and `gate_task.json` (the rule: lag, perm; the
training settings and results). The checkpoint as saved is reloaded in fp32 and checked on
fresh prompts like the gate's (`--eval-prompts` prompts of random ids, lengths
`--eval-prompt-len`, `--eval-tokens` continued tokens): the fraction of positions whose argmax
follows the rule, and the top-1 minus top-2 logit margin of the first generated token (min,
5th percentile, median). bf16 moves logits by ~0.05-0.3, so margins of several logits mean
first tokens that no rounding flips.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

TASK_FILE = "gate_task.json"
IGNORE = -100


# ---------------------------------------------------------------------------------------
# the model

def model_config(vocab: int = 1024, hidden: int = 256, intermediate: int = 512, layers: int = 4,
                 full_every: int = 4, tied: bool = True, **overrides):
    """A Qwen3_5TextConfig with the qwen3.5-0.8b preset's per-head shapes and rope, resized:
    `layers` layers, every `full_every`-th full attention (the rest GDN), eos = the last two
    ids. `overrides` replace any config field (tests: smaller heads)."""
    from transformers import Qwen3_5TextConfig

    from mstar.models import presets
    cfg = copy.deepcopy(presets.get("qwen3.5-0.8b").config)
    cfg.update(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               layer_types=["full_attention" if (i + 1) % full_every == 0 else "linear_attention"
                            for i in range(layers)],
               tie_word_embeddings=tied, eos_token_id=[vocab - 1, vocab - 2], pad_token_id=vocab - 2,
               max_position_embeddings=4096)
    cfg.update(overrides)
    return Qwen3_5TextConfig(**cfg)


def make_model(config, seed: int):
    """transformers' Qwen3_5ForCausalLM with its own init, drawn from `seed` (fp32, CPU)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# the task

@dataclass
class PermLagTask:
    """next(t_0 .. t_{n-1}) = perm[t_{n-lag}] (n >= lag)."""

    vocab: int
    lag: int
    perm: torch.Tensor  # [vocab] long: the identity (rule "copy") or a derangement ("perm")

    @classmethod
    def from_seed(cls, vocab: int, lag: int, seed: int, rule: str = "copy") -> PermLagTask:
        if lag < 1:
            raise ValueError("lag must be >= 1")
        if rule == "copy":
            return cls(vocab, lag, torch.arange(vocab))
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(vocab, generator=g)
        fixed = (perm == torch.arange(vocab)).nonzero().flatten().tolist()
        for i in fixed:  # no fixed points: perm[x] != x, so no continuation repeats a token
            j = (i + 1) % vocab
            perm[i], perm[j] = perm[j].clone(), perm[i].clone()
        assert not (perm == torch.arange(vocab)).any()
        return cls(vocab, lag, perm)

    def next_token(self, ctx: list[int]) -> int:
        """The rule's next token after `ctx` (len(ctx) >= lag)."""
        return int(self.perm[ctx[-self.lag]])

    def continue_(self, ctx: list[int], n: int) -> list[int]:
        """`n` tokens following the rule after `ctx`."""
        seq = list(ctx)
        for _ in range(n):
            seq.append(self.next_token(seq))
        return seq[len(ctx):]

    def labels(self, x: torch.Tensor) -> torch.Tensor:
        """Per position n-1 of x [B, L] the rule's next token after x[:, :n] (IGNORE where n < lag)."""
        lab = torch.full_like(x, IGNORE)
        lab[:, self.lag - 1:] = self.perm[x[:, :x.shape[1] - self.lag + 1]]
        return lab

    def batch(self, gen: torch.Generator, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [rows, length], labels): each row random ids up to a random cut in [1, length],
        then following the rule; labels = labels(inputs) (every position from lag - 1 on)."""
        x = torch.randint(0, self.vocab, (rows, length), generator=gen)
        cut = torch.randint(1, length + 1, (rows,), generator=gen)
        for j in range(self.lag, length):
            follow = cut <= j
            x[:, j] = torch.where(follow, self.perm[x[:, j - self.lag]], x[:, j])
        return x, self.labels(x)

    def describe(self) -> str:
        copy_ = bool((self.perm == torch.arange(self.vocab)).all())
        return f"t[n-{self.lag}]" if copy_ else f"perm[t[n-{self.lag}]]"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "next(t_0..t_{n-1}) = perm[t_{n-lag}] for n >= lag", "vocab": self.vocab, "lag": self.lag,
                "perm": self.perm.tolist()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PermLagTask:
        return cls(int(d["vocab"]), int(d["lag"]), torch.tensor(d["perm"], dtype=torch.long))

    @classmethod
    def load(cls, model_dir: str) -> PermLagTask:
        with open(os.path.join(model_dir, TASK_FILE)) as f:
            return cls.from_json(json.load(f)["task"])


# ---------------------------------------------------------------------------------------
# training

def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, task: PermLagTask, *, steps: int, seed: int, lr: float = 2e-3, warmup: int = 15,
          weight_decay: float = 0.01, tokens_per_step: int = 200, min_len: int = 16, max_len: int = 300,
          clip: float = 1.0, conv_lr_mult: float = 10.0, log_every: int = 50, log=print) -> dict[str, Any]:
    """AdamW on task batches (module docstring); returns the loss history and timing."""
    from mstar.bench.gate import torch_only_reference
    gen = torch.Generator().manual_seed(seed + 1)
    groups: dict[str, list] = {"decay": [], "conv": [], "rest": []}
    for n, p in model.named_parameters():
        groups["conv" if "conv1d" in n else "decay" if p.ndim >= 2 and "embed" not in n else "rest"].append(p)
    mult = {"decay": 1.0, "conv": conv_lr_mult, "rest": 1.0}
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": weight_decay if k == "decay" else 0.0, "mult": mult[k]}
                             for k, ps in groups.items() if ps], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    with torch_only_reference():
        for step in range(steps):
            length = int(torch.randint(min_len, max_len + 1, (), generator=gen))
            rows = max(1, tokens_per_step // length)
            x, y = task.batch(gen, rows, length)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup) * g["mult"]
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(loss.item())
            if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
                with torch.no_grad():
                    m = y != IGNORE
                    acc = (logits.argmax(-1)[m] == y[m]).float().mean().item()
                log(f"step {step + 1:>5}/{steps}  loss {loss.item():.3e}  acc {acc:.4f}  len {length:>3} x {rows:<3} "
                    f"lr {opt.param_groups[0]['lr']:.2e}  {time.perf_counter() - t0:6.1f} s")
    model.eval()
    tail = losses[-10:]
    return {"steps": steps, "train_s": round(time.perf_counter() - t0, 1), "final_loss": sum(tail) / len(tail),
            "losses": [round(v, 5) for v in losses]}


# ---------------------------------------------------------------------------------------
# evaluation on the gate's kind of prompts

@torch.no_grad()
def evaluate(model, task: PermLagTask, *, num_prompts: int = 64, prompt_len: tuple[int, int] = (16, 256),
             tokens: int = 32, seed: int = 999) -> dict[str, Any]:
    """Prompts as the gate makes them (random ids, lengths uniform in prompt_len), each continued
    by the rule for `tokens` tokens (= greedy generation wherever the model follows the rule);
    per position the argmax against the rule, and the top-1 minus top-2 logit margins."""
    from mstar.bench.gate import make_prompts, torch_only_reference
    prompts = make_prompts(num_prompts, prompt_len[0], prompt_len[1], task.vocab, seed)
    follow = total = first_follow = 0
    first_margins, all_margins = [], []
    model.eval()
    with torch_only_reference():
        for p in prompts:
            seq = p + task.continue_(p, tokens)
            lg = model(input_ids=torch.tensor([seq[:-1]])).logits[0, len(p) - 1:].float()  # [tokens, V]
            want = torch.tensor(seq[len(p):])
            top2 = lg.topk(2, dim=-1)
            ok = top2.indices[:, 0] == want
            # margin of the rule's token over the best other token (negative where it is not the argmax)
            other = lg.clone()
            other[torch.arange(len(want)), want] = -float("inf")
            margin = lg[torch.arange(len(want)), want] - other.max(-1).values
            follow += int(ok.sum())
            total += len(want)
            first_follow += int(ok[0])
            first_margins.append(float(margin[0]))
            all_margins += margin.tolist()

    def q(v, f):
        s = sorted(v)
        return s[min(len(s) - 1, int(f * len(s)))]
    return {"num_prompts": num_prompts, "prompt_len": list(prompt_len), "tokens": tokens, "seed": seed,
            "follow_frac": follow / total, "first_follow": first_follow,
            "first_margin_min": min(first_margins), "first_margin_p5": q(first_margins, 0.05),
            "first_margin_median": q(first_margins, 0.5),
            "all_margin_min": min(all_margins), "all_margin_p5": q(all_margins, 0.05)}


def format_eval(e: dict[str, Any]) -> str:
    return (f"{e['num_prompts']} prompts of {e['prompt_len'][0]}..{e['prompt_len'][1]} random ids (seed {e['seed']}), "
            f"{e['tokens']} rule tokens each:\n"
            f"  argmax follows the rule at {e['follow_frac']:.4f} of positions; first generated token: "
            f"{e['first_follow']}/{e['num_prompts']}\n"
            f"  first-token margin (top-1 - top-2 logit): min {e['first_margin_min']:.3f}, "
            f"p5 {e['first_margin_p5']:.3f}, median {e['first_margin_median']:.3f}\n"
            f"  all {e['tokens']} positions: min {e['all_margin_min']:.3f}, p5 {e['all_margin_p5']:.3f}")


# ---------------------------------------------------------------------------------------
# saving

_SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def save(model, task: PermLagTask, out: str, dtype: torch.dtype = torch.bfloat16,
         meta: dict[str, Any] | None = None) -> None:
    """save_pretrained (safetensors) in `dtype`, the gate's synthetic byte-level tokenizer of the
    vocabulary, and gate_task.json (the rule and `meta`)."""
    from mstar.bench.gate import synthetic_tokenizer
    os.makedirs(out, exist_ok=True)
    m = copy.deepcopy(model).to(dtype)
    m.save_pretrained(out, safe_serialization=True)
    eos = m.config.eos_token_id
    tok = synthetic_tokenizer(m.config.vocab_size, list(eos) if isinstance(eos, (list, tuple)) else [eos])
    tok.save_pretrained(out)
    with open(os.path.join(out, TASK_FILE), "w") as f:
        json.dump({"task": task.to_json(), **(meta or {})}, f)


def load_hf(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# ---------------------------------------------------------------------------------------

class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mstar.bench.gate_model", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=_Formatter)
    ap.add_argument("--out", required=True, help="checkpoint directory to write (created; files in it overwritten)")
    ap.add_argument("--steps", type=int, default=1200, help="training steps (AdamW updates)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the init, the permutation and the training batches (same seed and --threads: "
                         "same checkpoint)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (part of what makes a run repeatable)")
    g = ap.add_argument_group("model (per-head shapes are the qwen3.5-0.8b preset's)")
    g.add_argument("--vocab", type=int, default=1024, help="vocabulary size (>= 260: byte tokens + specials)")
    g.add_argument("--hidden", type=int, default=256, help="hidden size")
    g.add_argument("--intermediate", type=int, default=512, help="MLP intermediate size")
    g.add_argument("--layers", type=int, default=4, help="decoder layers")
    g.add_argument("--full-every", type=int, default=4, help="every N-th layer is full attention, the rest GDN")
    g.add_argument("--untied", action="store_true", help="an LM head of its own (else tied to the embedding)")
    g = ap.add_argument_group("task")
    g.add_argument("--rule", default="copy", choices=["copy", "perm"], help="copy: next = t[n-k] (perm = identity); perm: a random derangement of the "
                        "vocabulary from --seed (learns far slower)")
    g.add_argument("--lag", type=int, default=3, help="k in next = perm[t_{n-k}] (k <= 3: within the GDN short convolution's reach)")
    g = ap.add_argument_group("training")
    g.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (cosine decay to 10%%)")
    g.add_argument("--warmup", type=int, default=15, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (matrices only)")
    g.add_argument("--tokens-per-step", type=int, default=200,
                   help="tokens per batch: rows = max(1, this // the step's sequence length)")
    g.add_argument("--min-len", type=int, default=16, help="shortest training sequence")
    g.add_argument("--max-len", type=int, default=300,
                   help="longest training sequence (the gate's contexts reach 256 + 32)")
    g.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    g.add_argument("--conv-lr-mult", type=float, default=10.0,
                   help="learning-rate factor of the GDN short-convolution weights (their init is large next to "
                        "--lr: at 1x the loss sits at ln(vocab) for hundreds of steps longer)")
    g.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    g = ap.add_argument_group("saving and evaluation")
    g.add_argument("--save-dtype", default="bfloat16", choices=list(_SAVE_DTYPES),
                   help="dtype of the saved weights (the evaluation reloads them in fp32)")
    g.add_argument("--eval-prompts", type=int, default=64, help="evaluation prompts (random ids, like the gate's)")
    g.add_argument("--eval-prompt-len", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"),
                   help="evaluation prompt lengths, uniform in [LO, HI]")
    g.add_argument("--eval-tokens", type=int, default=32, help="rule tokens after each evaluation prompt")
    g.add_argument("--eval-seed", type=int, default=999, help="seed of the evaluation prompts (not the gate's 0)")
    args = ap.parse_args(argv)
    if args.vocab < 260:
        ap.error("--vocab must be >= 260")
    if args.steps < 1 or args.lag < 1 or not 1 <= args.min_len <= args.max_len or args.min_len <= args.lag:
        ap.error("need --steps >= 1, --lag >= 1 and --lag < --min-len <= --max-len")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = model_config(args.vocab, args.hidden, args.intermediate, args.layers, args.full_every, not args.untied)
    model = make_model(config, args.seed)
    task = PermLagTask.from_seed(args.vocab, args.lag, args.seed, args.rule)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"gate_model: Qwen3.5 {n_params / 1e6:.2f} M parameters (hidden {args.hidden}, {args.layers} layers "
          f"{''.join('F' if t == 'full_attention' else 'L' for t in config.layer_types)}, vocab {args.vocab}); "
          f"task next = {task.describe()}; {args.steps} steps on {args.threads} threads", flush=True)
    stats = train(model, task, steps=args.steps, seed=args.seed, lr=args.lr, warmup=args.warmup,
                  weight_decay=args.weight_decay, tokens_per_step=args.tokens_per_step, min_len=args.min_len,
                  max_len=args.max_len, clip=args.clip, conv_lr_mult=args.conv_lr_mult, log_every=args.log_every,
                  log=lambda s: print(s, flush=True))
    print(f"trained in {stats['train_s']:.1f} s; final loss (mean of the last 10 steps) {stats['final_loss']:.3e}",
          flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    save(model, task, args.out, _SAVE_DTYPES[args.save_dtype], {"settings": settings, "train": stats})
    reloaded = load_hf(args.out, torch.float32)
    ev = evaluate(reloaded, task, num_prompts=args.eval_prompts, prompt_len=tuple(args.eval_prompt_len),
                  tokens=args.eval_tokens, seed=args.eval_seed)
    path = os.path.join(args.out, TASK_FILE)
    with open(path) as f:
        meta = json.load(f)
    meta["eval"] = ev
    with open(path, "w") as f:
        json.dump(meta, f)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"saved {args.out} ({size / 2 ** 20:.1f} MiB, weights in {args.save_dtype}); reloaded in fp32:")
    print(format_eval(ev), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
