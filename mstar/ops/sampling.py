"""Token sampling: temperature, top-k, top-p, min-p, seeded counter-based randomness, logprobs;
and the repetition / presence / frequency penalties.

Randomness: no torch.Generator and no host sync. Each (seed, step, vocab index) is hashed
to a 32-bit integer with integer ops only (so every device gives the same bits), turned
into a uniform u in (0, 1), and the token is the Gumbel-max winner

    argmax_i  logit_i / T - log(-log u_i)      over the tokens the filters keep,

which draws exactly from softmax(logit / T) restricted to the kept set and renormalised.
A row's token therefore depends only on its own logits, parameters, seed and step: it is
the same alone or inside any batch.
"""

from __future__ import annotations

import torch

from mstar.ops.registry import define_op

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (xorshift-multiply) of int64 x in [0, 2^32).

    The multipliers are odd and below 2^31, so every product stays below 2^63: no signed
    overflow anywhere, the same bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x045D9F3B) & _M32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from the 64-bit seed and step."""
    s, t = seeds.to(torch.int64), steps.to(torch.int64)
    a = _mix32(s & _M32)
    a = _mix32(a ^ ((s >> 32) & _M32))
    a = _mix32(a ^ (t & _M32))
    a = _mix32(a ^ ((t >> 32) & _M32))
    b = _mix32(a ^ 0x9E3779B9)
    return a, b


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[b, i] in (0, 1), float32, a pure function of (seeds[b], steps[b], i).

    23 random bits: u = (2m + 1) / 2^24, m in [0, 2^23), exact in float32, never 0 or 1."""
    a, b = _row_keys(seeds, steps)
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32(_mix32(idx.unsqueeze(0) ^ a.unsqueeze(1)) ^ b.unsqueeze(1))
    m = h >> 9
    return (m * 2 + 1).to(torch.float32) * (2.0 ** -24)


def _sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row; (tokens, logprob of token, top ids, top logprobs)."""
    V = logits.shape[1]
    dev = logits.device
    lf = logits.to(torch.float32)
    logprobs_all = torch.log_softmax(lf, dim=-1)

    greedy = temperature <= 0
    greedy_tok = lf.argmax(dim=-1)

    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = lf / t.unsqueeze(1)
    # filters in sorted order (descending; ties by lowest index)
    sv, si = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=dev).unsqueeze(0)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
    drop = rank >= k.unsqueeze(1)  # top-k
    sv = sv.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sv, dim=-1)  # renormalised over the top-k
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each rank
    p = top_p.to(torch.float32).unsqueeze(1)
    drop = drop | ((before >= p) & (p < 1.0) & (rank > 0))  # top-p: smallest set with mass >= p
    mp = min_p.to(torch.float32).unsqueeze(1)
    drop = drop | ((probs < mp * probs[:, :1]) & (rank > 0))  # min-p: relative to the top token
    sv = sv.masked_fill(drop, float("-inf"))

    u = uniform_noise(seeds, steps, V).gather(1, si)
    gumbel = -torch.log(-torch.log(u))
    win = (sv + gumbel).argmax(dim=-1, keepdim=True)
    sampled = si.gather(1, win).squeeze(1)

    tokens = torch.where(greedy, greedy_tok, sampled)
    tok_lp = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = torch.topk(logprobs_all, num_logprobs, dim=-1)
    return tokens, tok_lp, top_ids, top_lp


def greedy_sample(logits: torch.Tensor, num_logprobs: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `sample` returns when every row is greedy, without its sort over the vocabulary
    (the runtime knows on the host when a batch is all greedy, so no device sync decides it).
    Same tokens as `sample` (argmax, ties to the lowest index) and the same logprobs."""
    lf = logits.to(torch.float32)
    tokens = lf.argmax(dim=-1)
    logprobs_all = torch.log_softmax(lf, dim=-1)
    tok_lp = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = torch.topk(logprobs_all, num_logprobs, dim=-1)
    return tokens, tok_lp, top_ids, top_lp


def _sample_fake(logits, temperature, top_k, top_p, min_p, seeds, steps, num_logprobs):
    B = logits.shape[0]
    dev = logits.device
    return (torch.empty((B,), dtype=torch.int64, device=dev), torch.empty((B,), dtype=torch.float32, device=dev),
            torch.empty((B, num_logprobs), dtype=torch.int64, device=dev),
            torch.empty((B, num_logprobs), dtype=torch.float32, device=dev))


sample = define_op(
    "sample",
    "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, "
    "Tensor steps, int num_logprobs) -> (Tensor, Tensor, Tensor, Tensor)",
    reference=_sample_ref, fake=_sample_fake)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition_penalty: torch.Tensor, presence_penalty: torch.Tensor,
                    frequency_penalty: torch.Tensor) -> torch.Tensor:
    """Penalised copy of logits [B, V] (float32).

    repetition (tokens in the prompt or generated so far): logit / rp if logit > 0 else logit * rp;
    then presence: -= presence if generated at least once; frequency: -= frequency * count.
    A penalty of 1 (repetition) or 0 (the others) leaves a row unchanged."""
    lf = logits.to(torch.float32)
    counts = output_counts.to(torch.float32)
    generated = output_counts > 0
    rp = repetition_penalty.to(torch.float32).unsqueeze(1)
    seen = prompt_mask | generated
    penalised = torch.where(lf > 0, lf / rp, lf * rp)
    out = torch.where(seen, penalised, lf)
    out = out - presence_penalty.to(torch.float32).unsqueeze(1) * generated.to(torch.float32)
    out = out - frequency_penalty.to(torch.float32).unsqueeze(1) * counts
    return out


__all__ = ["sample", "greedy_sample", "apply_penalties"]
