"""Token sampling: temperature, top-k, top-p, min-p, seeded counter-based randomness, logprobs;
and the repetition / presence / frequency penalties.

Randomness: no torch.Generator and no host sync. Each (seed, step, vocab index) is hashed
to a 32-bit integer with integer ops only (so every device gives the same bits), turned
into a uniform u in (0, 1), and the token is the Gumbel-max winner

    argmax_i  logit_i / T - log(-log u_i)      over the tokens the filters keep,

which draws exactly from softmax(logit / T) restricted to the kept set and renormalised.
A row's token therefore depends only on its own logits, parameters, seed and step: it is
the same alone or inside any batch.

Two implementations of `sample`, the same tokens:

    reference   sorts the whole vocabulary per row (the ground truth; 9.5 ms at batch 128 on an H200)
    torch_topk  no full sort (pure torch, CPU and CUDA; the default): a row with top-k <= K, or with
                top-p, is decided on its K (>= 1024) largest logits, a row with only temperature /
                min-p by one Gumbel-max pass over the vocabulary; the few rows these cannot decide
                exactly (top-p whose kept mass lies beyond the K candidates, top-k > 4096, ties
                straddling the K-th logit) are flagged and redone: on 16384 candidates, then
                by the reference.

`make_plan` picks the stages from the parameters on the host and `sample_planned` runs them
without any host sync, returning per-row `exact` flags; the Sampler (which keeps the
parameters on the host) reads the flags with the tokens it reads anyway. The op backend
`torch_topk` has only device tensors, so it reads the parameters (one sync) and, when a
candidate stage ran, the flags (a second).

"The same tokens" is bit-for-bit: the fast stages compute the reference's own float values
(the same divisions, noise, softmax over the same kept values, cumsum over the same prefix),
with two exceptions at the last place: a top-p row without top-k (and a min-p-only row) sums
its softmax over the row in vocabulary order where the reference sums in sorted order, and on
CUDA the reductions over K candidates may associate differently than over V. Either changes a
token only when a cumulative mass lies within float rounding of top_p (or a probability within
rounding of min_p x the top one): where the reference itself answers differently on CPU and
CUDA. On CPU, every test (random mixes, ties, masks) gives the reference's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mstar.ops.registry import define_op, register_backend

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
    return _uniform_at(seeds, steps, torch.arange(vocab_size, device=seeds.device, dtype=torch.int64).unsqueeze(0))


# On CUDA, set by mstar/ops/backends/triton_sampling.py: _uniform_at in one kernel (the same bits)
UNIFORM_AT_CUDA = None


def _uniform_at(seeds: torch.Tensor, steps: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """uniform_noise(seeds, steps, V)[b, idx[b, j]] for idx [B, J] (or [1, J], the same columns
    for every row) int64, without the other columns."""
    if idx.is_cuda and UNIFORM_AT_CUDA is not None and not torch.compiler.is_compiling():
        return UNIFORM_AT_CUDA(seeds, steps, idx)
    a, b = _row_keys(seeds, steps)
    h = _mix32(_mix32(idx ^ a.unsqueeze(1)) ^ b.unsqueeze(1))
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)


def normal_noise(seeds: torch.Tensor, stream: int, length: int) -> torch.Tensor:
    """n[b, t] ~ N(0, 1), float32 [B, length], a pure function of (seeds[b], stream, t): the same
    counter-based bits as the sampler's (stream 2s and 2s + 1 give the two uniforms of a Box-Muller
    pair), so a row's noise does not depend on the batch it rides in, and the draw needs no
    torch.Generator (a CUDA graph can replay it: the seeds are its only input)."""
    idx = torch.arange(length, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    steps = torch.full_like(seeds, 2 * int(stream), dtype=torch.int64)
    u1 = _uniform_at(seeds, steps, idx)
    u2 = _uniform_at(seeds, steps + 1, idx)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """_mix32 in place (the same bits, fewer temporaries)."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x045D9F3B).bitwise_and_(_M32)
    x ^= x >> 16
    return x


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


# --- the fast path: backend "torch_topk" --------------------------------------------------------

_CANDIDATES = 1024  # candidates per row for top-p (and the least for top-k)
_REDO_CANDIDATES = 16384  # the second try for rows the first left undecided (flat top-p rows)
_MAX_TOP_K = 4096  # top-k rows with k below this are decided on candidates; larger k: the reference
# Every Gumbel value the noise gives lies below this: u <= 1 - 2^-24, so -log(-log u) <= 16.6355...
# (the margin covers a float32 log's last-place error).
_G_BOUND = 16.64
_NEG_INF = float("-inf")
_CPU_CHUNK_ELEMS = 1 << 17  # the one-pass Gumbel-max on CPU: elements per column chunk (cache-sized)
_CPU_CHUNK_MIN = 2048


@dataclass(frozen=True)
class SamplePlan:
    """The stages one `sample_planned` call runs, decided on the host from the parameters.

    candidates  K > 0: decide rows on their K largest logits (top-k rows, top-p rows); 0: no such stage
    full_norm   that stage needs the whole row's softmax normaliser (a top-p row without top-k)
    full_rows   rows decided by one Gumbel-max pass over the vocabulary (temperature / min-p only)
    full_minp   some of those rows has min-p (the pass needs the row's softmax)
    ref_rows    rows the reference sorts (top-k between _MAX_TOP_K and the vocabulary size)
    any_greedy  some row is greedy
    complete    every row is certainly decided (no candidate stage short of the vocabulary)
    """
    candidates: int
    full_norm: bool
    full_rows: tuple[int, ...]
    full_minp: bool
    ref_rows: tuple[int, ...]
    any_greedy: bool
    complete: bool


def make_plan(temperature, top_k, top_p, min_p, vocab_size: int, candidates: int = _CANDIDATES,
              max_finite: int | None = None) -> SamplePlan:
    """The plan for one batch from its parameters on the host (sequences or numpy arrays; float32
    values as the device holds them, so the host and the device classify rows alike).
    `candidates`: the least K of the candidate stage. `max_finite`: no row has more finite logits
    than this (a family's constraint masks the rest to -inf): a candidate stage of K >= it holds
    every token a row can draw, so it decides every row (the plan is complete)."""
    V = int(vocab_size)
    if max_finite is not None and max_finite < V:
        candidates = max(candidates, -(-int(max_finite) // 256) * 256)
    T = np.asarray(temperature, dtype=np.float32)
    k = np.asarray(top_k, dtype=np.int64)
    p = np.asarray(top_p, dtype=np.float32)
    mp = np.asarray(min_p, dtype=np.float32)
    greedy = T <= 0
    active = ~greedy
    keff = np.where((k <= 0) | (k > V), V, k)
    full = active & (keff >= V) & (p >= 1)  # no top-k, no top-p: temperature (and min-p) only
    topp = active & (keff >= V) & (p < 1)
    small = active & (keff < V) & (keff < _MAX_TOP_K)
    ref = active & ~full & ~topp & ~small
    K = 0
    if small.any() or topp.any():
        K = candidates
        if small.any():  # K above every row's k: a kept set never reaches the K-th logit's ties
            K = max(K, -(-(int(keff[small].max()) + 1) // 256) * 256)
        K = min(K, V)
    return SamplePlan(candidates=K, full_norm=bool(topp.any()) and K < V,
                      full_rows=tuple(np.nonzero(full)[0].tolist()), full_minp=bool((full & (mp > 0)).any()),
                      ref_rows=tuple(np.nonzero(ref)[0].tolist()), any_greedy=bool(greedy.any()),
                      complete=K == 0 or K >= V or (max_finite is not None and K >= max_finite))


def whole_row_plan(width: int, any_greedy: bool) -> SamplePlan:
    """The plan of a batch whose every row is a row's whole candidate set (Sampler col_ids): one
    candidate stage over all `width` columns, which is the reference's own computation (complete)."""
    return SamplePlan(candidates=int(width), full_norm=False, full_rows=(), full_minp=False, ref_rows=(),
                      any_greedy=bool(any_greedy), complete=True)


def _candidate_stage(lf, t, k, p, mp, seeds, steps, K: int, full_norm: bool, col_ids=None):
    """Each row decided on its K largest logits: (tokens, decided [B] bool).

    The candidates, put in the reference's order (scaled value descending, ties by lowest
    index), hold the reference's sorted row exactly at every rank whose value is above the
    K-th one (v_last); ranks tied with v_last may hold other indices than the reference's
    (ties outside the K). The filters run on the candidates as the reference runs them on
    the sorted row. A row is decided when every kept rank lies above v_last and the ranks
    beyond K are dropped (top-k <= K, or top-p / min-p drop the K-th rank), or when the winner's
    noisy value beats v_last + the largest Gumbel value (then nothing outside can win)."""
    B, V = lf.shape
    dev = lf.device
    if K >= V:  # the whole row: one stable sort (ties by the lower column, as the reference)
        sv, si = torch.sort(lf / t.unsqueeze(1), dim=-1, descending=True, stable=True)
    else:
        cv, ci = torch.topk(lf, K, dim=-1)
        sc = cv / t.unsqueeze(1)  # the same bits as the reference's lf / t at these indices
        ci, o = torch.sort(ci, dim=-1)
        sv, o = torch.sort(sc.gather(1, o), dim=-1, descending=True, stable=True)
        si = ci.gather(1, o)
    rank = torch.arange(K, device=dev).unsqueeze(0)
    drop = rank >= k.unsqueeze(1)  # top-k
    probs = torch.softmax(sv.masked_fill(drop, _NEG_INF), dim=-1)  # the reference's, when k <= K
    if full_norm:  # rows without top-k: normalised over the whole row
        pf = torch.softmax(lf / t.unsqueeze(1), dim=-1).gather(1, si)
        probs = torch.where((k <= K).unsqueeze(1), probs, pf)
    before = torch.cumsum(probs, dim=-1) - probs
    pp = p.unsqueeze(1)
    drop = drop | ((before >= pp) & (pp < 1.0) & (rank > 0))  # top-p
    drop = drop | ((probs < mp.unsqueeze(1) * probs[:, :1]) & (rank > 0))  # min-p
    u = _uniform_at(seeds, steps, si if col_ids is None else col_ids.gather(1, si))  # noise keyed on the token id
    z = sv.masked_fill(drop, _NEG_INF) + (-torch.log(-torch.log(u)))
    win = z.argmax(dim=-1, keepdim=True)
    tok = si.gather(1, win).squeeze(1)
    if K >= V:  # the candidates are the whole sorted row: the reference's own computation
        return tok, torch.ones(B, dtype=torch.bool, device=dev)
    zmax = z.gather(1, win).squeeze(1)
    v_last = sv[:, -1]
    n_safe = (sv > v_last.unsqueeze(1)).sum(dim=-1, keepdim=True)
    kept_uncertain = (~drop & (rank >= n_safe)).any(dim=-1)
    nofilter = (p >= 1.0) & (mp <= 0.0)
    low_inf = v_last == _NEG_INF  # every finite logit is a candidate
    probs_ok = (k <= K) | nofilter | low_inf | ((k >= V) & full_norm)
    beyond_dropped = (k <= K) | ((k >= V) & drop[:, -1])  # drops are monotone in rank past K
    decided = low_inf | (~kept_uncertain & beyond_dropped)
    beats_outside = (zmax > v_last + _G_BOUND) & ((k >= V) | nofilter)
    return tok, (sv[:, 0] > _NEG_INF) & probs_ok & (decided | beats_outside)


def _gumbel_argmax(masked: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The reference's winner over a row in vocabulary order: argmax of masked + gumbel, ties in
    that sum to the larger masked value, then the lower index (its sorted order).

    On CPU in column chunks (the noise's temporaries stay in cache), on CUDA in one go."""
    R, V = masked.shape
    dev = masked.device
    a, b = _row_keys(seeds, steps)
    a, b = a.unsqueeze(1), b.unsqueeze(1)
    chunk = V if masked.is_cuda else max(_CPU_CHUNK_MIN, _CPU_CHUNK_ELEMS // max(R, 1))
    best_z = torch.full((R,), _NEG_INF, device=dev)
    best_s = torch.full((R,), _NEG_INF, device=dev)
    best_i = torch.zeros((R,), dtype=torch.int64, device=dev)
    for c0 in range(0, V, chunk):
        c1 = min(V, c0 + chunk)
        x = torch.arange(c0, c1, device=dev, dtype=torch.int64).unsqueeze(0) ^ a
        x = _mix32_(x)
        x ^= b
        x = _mix32_(x)
        x >>= 9
        g = x.mul_(2).add_(1).to(torch.float32).mul_(2.0 ** -24)  # uniform_noise's u
        g = g.log_().neg_().log_().neg_()  # -log(-log u)
        s = masked[:, c0:c1]
        z = s + g
        m = z.max(dim=-1, keepdim=True).values
        w = torch.where(z == m, s, _NEG_INF)
        j = w.argmax(dim=-1, keepdim=True)
        sm = w.gather(1, j).squeeze(1)
        j = j.squeeze(1)
        m = m.squeeze(1)
        take = (m > best_z) | ((m == best_z) & (sm > best_s))
        best_z = torch.where(take, m, best_z)
        best_s = torch.where(take, sm, best_s)
        best_i = torch.where(take, j + c0, best_i)
    return best_i


def _full_stage(lf, t, mp, seeds, steps, use_minp: bool, full_impl=None) -> torch.Tensor:
    """Tokens of rows without top-k and top-p: one Gumbel-max pass, min-p as a mask.
    full_impl(lf, t, seeds, steps): a fused kernel for the pass without min-p (Triton)."""
    if full_impl is not None and not use_minp:
        return full_impl(lf, t, seeds, steps)
    scaled = lf / t.unsqueeze(1)
    if use_minp:
        probs = torch.softmax(scaled, dim=-1)
        pmax = probs.max(dim=-1, keepdim=True).values  # the top rank's probability
        drop = probs < mp.unsqueeze(1) * pmax
        drop.scatter_(1, scaled.argmax(dim=-1, keepdim=True), False)  # the top rank is always kept
        scaled = scaled.masked_fill(drop, _NEG_INF)
    return _gumbel_argmax(scaled, seeds, steps)


def _rows(rows: tuple[int, ...], B: int, dev):
    if len(rows) == B:
        return slice(None)
    return torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)


def sample_planned(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, num_logprobs: int,
                   plan: SamplePlan, full_impl=None, token_logprobs: bool = True, col_ids=None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample` by the stages of `plan` (= make_plan of these parameters), with no host sync.

    col_ids [B, V] int64 (with plan = whole_row_plan(V, ...)): column j of row b stands for token
    col_ids[b, j] (a row's candidates, ascending; its logit -inf where it pads), and the noise is
    keyed on those ids, so the draw is the one over the whole vocabulary with every other logit
    -inf. Tokens come back as columns (the caller maps them); no logprobs.

    Returns (tokens, token logprob, top ids, top logprobs, exact). Where exact[b], row b's
    outputs are the reference's; elsewhere its token (and token logprob) is undecided and must be
    redone (`redo_rows`). Top ids / logprobs never depend on the token. token_logprobs=False
    with num_logprobs=0 skips the log-softmax over the vocabulary (token logprobs are then 0).

    Float caveat: a top-p row without top-k (or a min-p-only row) normalises its probabilities
    over the row in vocabulary order, the reference in sorted order; the two sums can differ in
    the last place, which changes a token only when a cumulative mass (or probability) lies
    within that rounding of top-p (min-p x the top probability), where the reference itself
    answers differently on CPU and CUDA."""
    B, V = logits.shape
    dev = logits.device
    if col_ids is not None and (plan.full_rows or plan.ref_rows or plan.candidates < V or num_logprobs):
        raise ValueError("sample_planned: col_ids takes whole_row_plan and no logprobs")
    lf = logits.to(torch.float32)
    logprobs_all = torch.log_softmax(lf, dim=-1) if token_logprobs or num_logprobs else None
    greedy = temperature <= 0
    if plan.any_greedy:
        tokens = lf.argmax(dim=-1)
        exact = greedy.clone()
    else:
        tokens = torch.zeros((B,), dtype=torch.int64, device=dev)
        exact = torch.zeros((B,), dtype=torch.bool, device=dev)
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
    p = top_p.to(torch.float32)
    mp = min_p.to(torch.float32)
    if plan.candidates:
        tok_c, ok_c = _candidate_stage(lf, t, k, p, mp, seeds, steps, plan.candidates, plan.full_norm, col_ids)
        ok_c = ok_c & ~greedy
        tokens = torch.where(ok_c, tok_c, tokens)
        exact = exact | ok_c
    if plan.full_rows:
        r = _rows(plan.full_rows, B, dev)
        tok_f = _full_stage(lf[r], t[r], mp[r], seeds[r], steps[r], plan.full_minp, full_impl)
        ok_f = ~greedy[r] & (k[r] >= V) & (p[r] >= 1.0)
        tokens[r] = torch.where(ok_f, tok_f, tokens[r])
        exact[r] = exact[r] | ok_f
    if plan.ref_rows:
        r = _rows(plan.ref_rows, B, dev)
        tok_r = _sample_ref(lf[r], temperature[r], top_k[r], top_p[r], min_p[r], seeds[r], steps[r], 0)[0]
        tokens[r] = tok_r
        exact[r] = torch.ones_like(tok_r, dtype=torch.bool)  # `= True` copies a host scalar: a sync
    if logprobs_all is None:
        tok_lp = torch.zeros((B,), dtype=torch.float32, device=dev)
        top_lp = torch.empty((B, 0), dtype=torch.float32, device=dev)
        top_ids = torch.empty((B, 0), dtype=torch.int64, device=dev)
    else:
        tok_lp = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top_lp, top_ids = torch.topk(logprobs_all, num_logprobs, dim=-1)
    return tokens, tok_lp, top_ids, top_lp, exact


def _read_plan(temperature, top_k, top_p, min_p, vocab_size: int, candidates: int = _CANDIDATES) -> SamplePlan:
    """make_plan of device parameter tensors, read to the host in one copy (a sync on CUDA)."""
    host = torch.stack([x.to(torch.float64) for x in (temperature, top_k, top_p, min_p)]).cpu().numpy()
    return make_plan(host[0], host[1].astype(np.int64), host[2], host[3], vocab_size, candidates)


def redo_rows(out: tuple, rows: list[int], logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Decide `rows` of a `sample_planned` result that it left undecided, in place (tokens, token
    logprobs, exact); returns the rows' new tokens.

    The rare path, with host syncs: a second candidate stage with _REDO_CANDIDATES candidates
    (a flat top-p row keeps thousands of tokens), then the reference for what is still open."""
    tokens, tok_lp, _, _, exact = out
    dev = logits.device
    r = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    sub = (logits[r], temperature[r], top_k[r], top_p[r], min_p[r], seeds[r], steps[r])
    V = logits.shape[1]
    tok, lp = None, None
    if V > _CANDIDATES:
        plan = _read_plan(*sub[1:5], V, candidates=_REDO_CANDIDATES)
        tok, lp, _, _, ok = sample_planned(*sub, 0, plan)
        still = torch.nonzero(~ok).flatten().tolist()
    else:
        still = list(range(len(rows)))
    if still:
        s = torch.tensor(still, dtype=torch.int64).to(dev, non_blocking=True)
        rt, rl, _, _ = _sample_ref(*(x[s] for x in sub), 0)
        if tok is None:
            tok, lp = rt, rl
        else:
            tok[s] = rt
            lp[s] = rl
    tokens[r] = tok
    tok_lp[r] = lp
    exact[r] = True
    return tok


def sample_fast(logits, temperature, top_k, top_p, min_p, seeds, steps, num_logprobs, full_impl=None):
    """`sample` without a full sort, as an op backend: reads the parameters (one sync on CUDA) to
    plan, and the exact flags (a second) when a candidate stage may have left rows undecided."""
    plan = _read_plan(temperature, top_k, top_p, min_p, logits.shape[1])
    out = sample_planned(logits, temperature, top_k, top_p, min_p, seeds, steps, num_logprobs, plan, full_impl)
    if not plan.complete:
        bad = torch.nonzero(~out[4]).flatten().tolist()
        if bad:
            redo_rows(out, bad, logits, temperature, top_k, top_p, min_p, seeds, steps)
    return out[:4]


register_backend(sample, "torch_topk", sample_fast, devices=("cpu", "cuda"), priority=5,
                 note="top-k / top-p on the K largest logits, one Gumbel-max pass otherwise; no full sort")

# Backends of `sample` that are `sample_planned` with a given one-pass kernel (None: torch): the
# Sampler runs these itself from its host plan, without the backend's syncs.
PLANNED_BACKENDS: dict[str, object] = {"torch_topk": None}


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


# (make_plan, sample_planned, redo_rows: used by the Sampler from this module, not exported into ops)
__all__ = ["sample", "greedy_sample", "apply_penalties"]
