"""The sample op (greedy, temperature, top-k / top-p / min-p, counter-based randomness,
logprobs) and apply_penalties; the fast backend `torch_topk` (the default) against the
full-sort reference, token for token.

Statistical checks use fixed seeds (so they are deterministic) and N = 20000 draws: every
empirical frequency must lie within 5 standard deviations sqrt(p(1-p)/N) of its float64
probability, and Pearson's chi-square must stay below the 0.9999 quantile bound used below."""

import math

import pytest
import torch

from mstar import knobs, ops
from mstar.ops import sampling
from mstar.ops.sampling import uniform_noise

N = 20000
REF = ops.sample.backends["reference"].fn
FAST = ops.sample.backends["torch_topk"].fn


@pytest.fixture(params=["reference", "torch_topk"])
def backend(request):
    """Run a test on each backend of `sample` (selected by the knob, as in production)."""
    with knobs.override(MSTAR_BACKENDS=f"sample={request.param}"):
        assert ops.sample.selected("cpu") == request.param
        yield request.param


def _params(B, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=None):
    f = lambda val, dt: torch.full((B,), val, dtype=dt)  # noqa: E731
    return (f(temperature, torch.float32), f(top_k, torch.int64), f(top_p, torch.float32), f(min_p, torch.float32),
            torch.arange(B, dtype=torch.int64) if seeds is None else seeds,
            torch.zeros(B, dtype=torch.int64) if steps is None else steps)


def _allowed_probs(logits, temperature, top_k, top_p, min_p):
    """float64 reference for one row: the filtered, renormalised distribution."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(p, descending=True, stable=True)
    ps = p[order]
    keep = torch.ones_like(ps, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    ps = torch.where(keep, ps, 0.0)
    ps = ps / ps.sum()
    if top_p < 1.0:
        before = torch.cumsum(ps, 0) - ps
        assert ((before - top_p).abs() > 1e-4).all(), "test case too close to the top-p boundary"
        keep &= before < top_p
        keep[0] = True
    if min_p > 0.0:
        keep &= ps >= min_p * ps[0]
    out = torch.zeros_like(p)
    out[order] = torch.where(keep, ps, 0.0)
    return out / out.sum()


def _check_distribution(tokens, probs, what):
    V = probs.numel()
    counts = torch.bincount(tokens, minlength=V).double()
    freq = counts / tokens.numel()
    assert (counts[probs == 0] == 0).all(), f"{what}: sampled a token outside the allowed set"
    sd = (probs * (1 - probs) / tokens.numel()).sqrt()
    dev = ((freq - probs).abs() / sd.clamp_min(1e-12))[probs > 0]
    assert dev.max() < 5.0, f"{what}: frequency {dev.max():.2f} sd from its probability"
    support = probs > 0
    expected = probs[support] * tokens.numel()
    chi2 = (((counts[support] - expected) ** 2) / expected).sum().item()
    df = int(support.sum()) - 1
    # Wilson-Hilferty bound for the 0.9999 chi-square quantile (z = 3.72)
    bound = df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3 if df > 0 else 0.0
    assert chi2 <= bound + 1e-9, f"{what}: chi2 {chi2:.1f} > {bound:.1f} (df {df})"


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    B, V = 8, 1000
    logits = torch.randn(B, V, generator=gen)
    logits[0, 10] = logits[0, 700] = 50.0  # tie: lowest index wins
    logits[1, :] = 0.0  # all tied
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.7, 0.0, 1.3])
    params = _params(B)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lg = logits.to(dtype)
        tok, *_ = ops.sample(lg, temperature, *params[1:], 0)
        am = lg.float().argmax(-1)
        greedy = temperature == 0
        assert torch.equal(tok[greedy], am[greedy])
        assert tok[0] == 10 and tok[1] == 0


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_distribution_matches_softmax(temperature, backend):
    gen = torch.Generator().manual_seed(1)
    V = 12
    logits = torch.randn(V, generator=gen) * 1.5
    probs = torch.softmax(logits.double() / temperature, -1)
    # many requests (seeds), one step each
    tok, *_ = ops.sample(logits.expand(N, V), *_params(N, temperature), 0)
    _check_distribution(tok, probs, f"over seeds, T={temperature}")
    # one request, many steps
    tok, *_ = ops.sample(logits.expand(N, V), *_params(N, temperature, seeds=torch.full((N,), 1234567890123),
                                                       steps=torch.arange(N)), 0)
    _check_distribution(tok, probs, f"over steps, T={temperature}")


_P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005])


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,n_allowed", [
    (1.0, 4, 1.0, 0.0, 4),
    (1.0, 0, 0.6, 0.0, 3),
    (1.0, 0, 1.0, 0.25, 5),
    (1.0, 6, 0.8, 0.1, 4),
    (1.0, 0, 0.9, 0.3, 4),
    (2.0, 0, 0.5, 0.0, None),
    (0.5, 8, 0.97, 0.02, None),
    (1.0, 1, 1.0, 0.0, 1),
    (1.0, 0, 0.1, 0.0, 1),
])
def test_filters_stay_in_allowed_set(temperature, top_k, top_p, min_p, n_allowed, backend):
    gen = torch.Generator().manual_seed(2)
    perm = torch.randperm(len(_P), generator=gen)  # sorted order != index order
    logits = (_P.log() + 3.0)[perm]
    probs = _allowed_probs(logits, temperature, top_k, top_p, min_p)
    if n_allowed is not None:
        assert int((probs > 0).sum()) == n_allowed
    tok, *_ = ops.sample(logits.expand(N, -1), *_params(N, temperature, top_k, top_p, min_p), 0)
    _check_distribution(tok, probs, f"T={temperature} k={top_k} p={top_p} min_p={min_p}")


def _mixed_batch(B, V, gen):
    logits = torch.randn(B, V, generator=gen) * 3
    temperature = torch.rand(B, generator=gen) * 1.5
    temperature[::4] = 0.0
    top_k = torch.randint(-1, 50, (B,), generator=gen)
    top_p = torch.where(torch.rand(B, generator=gen) < 0.5, torch.ones(B), torch.rand(B, generator=gen))
    min_p = torch.where(torch.rand(B, generator=gen) < 0.5, torch.zeros(B), torch.rand(B, generator=gen) * 0.3)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (B,), generator=gen)
    steps = torch.randint(0, 5000, (B,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds, steps


def test_batch_independence(backend):
    gen = torch.Generator().manual_seed(3)
    B, V = 16, 5000
    args = _mixed_batch(B, V, gen)
    tok, lp, ti, tl = ops.sample(*args, 4)
    perm = torch.randperm(B, generator=gen)
    tok_p, lp_p, ti_p, tl_p = ops.sample(*(a[perm] for a in args), 4)
    assert torch.equal(tok_p, tok[perm]) and torch.equal(lp_p, lp[perm]) and torch.equal(ti_p, ti[perm])
    assert torch.equal(tl_p, tl[perm])
    for i in range(B):
        t1, l1, i1, _ = ops.sample(*(a[i:i + 1] for a in args), 4)
        assert t1.item() == tok[i].item(), f"row {i} differs alone"
        assert l1.item() == lp[i].item() and torch.equal(i1[0], ti[i])


def test_reproducible_and_steps_differ(backend):
    V = 1000
    logits = torch.zeros(1, V)  # uniform: any change of randomness changes the token
    p = _params(1)
    seed = torch.tensor([42])
    toks = [ops.sample(logits, p[0], p[1], p[2], p[3], seed, torch.tensor([s]), 0)[0].item() for s in range(64)]
    again = [ops.sample(logits, p[0], p[1], p[2], p[3], seed, torch.tensor([s]), 0)[0].item() for s in range(64)]
    assert toks == again
    assert len(set(toks)) > 55  # 64 draws from 1000: collisions are rare
    other = [ops.sample(logits, p[0], p[1], p[2], p[3], torch.tensor([43]), torch.tensor([s]), 0)[0].item()
             for s in range(64)]
    assert sum(a == b for a, b in zip(toks, other)) < 4


def test_noise_is_uniform_and_decorrelated():
    seeds = torch.arange(500, dtype=torch.int64) * 7919 - 10 ** 12
    steps = torch.arange(500, dtype=torch.int64) % 17
    u = uniform_noise(seeds, steps, 2000).double()
    assert u.min() > 0 and u.max() < 1
    n = u.numel()
    hist = torch.histc(u, bins=20, min=0, max=1) / n
    assert (hist - 0.05).abs().max() < 5 * math.sqrt(0.05 * 0.95 / n)
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    # neighbours in vocab index and in seed are uncorrelated
    c = lambda a, b: torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs().item()  # noqa: E731
    assert c(u[:, 1:], u[:, :-1]) < 5 / math.sqrt(n)
    assert c(u[1:], u[:-1]) < 5 / math.sqrt(n)
    # consecutive steps of one seed
    v = uniform_noise(torch.full((500,), 9, dtype=torch.int64), torch.arange(500), 2000).double()
    assert c(v[1:], v[:-1]) < 5 / math.sqrt(n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs(dtype, backend):
    gen = torch.Generator().manual_seed(4)
    B, V = 6, 3000
    args = _mixed_batch(B, V, gen)
    logits = args[0].to(dtype)
    tok, lp, top_ids, top_lp = ops.sample(logits, *args[1:], 5)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(lp.double(), ref.gather(1, tok[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    r_lp, r_ids = ref.topk(5, dim=-1)
    assert torch.equal(top_ids, r_ids)
    torch.testing.assert_close(top_lp.double(), r_lp, atol=1e-5, rtol=1e-5)
    assert lp.dtype == top_lp.dtype == torch.float32 and tok.dtype == top_ids.dtype == torch.int64
    tok0, _, ids0, lp0 = ops.sample(logits, *args[1:], 0)
    assert ids0.shape == (B, 0) and lp0.shape == (B, 0) and torch.equal(tok0, tok)


def test_apply_penalties_vs_loop():
    gen = torch.Generator().manual_seed(5)
    B, V = 4, 60
    logits = torch.randn(B, V, generator=gen) * 3
    prompt_mask = torch.rand(B, V, generator=gen) < 0.2
    counts = torch.randint(0, 4, (B, V), generator=gen) * (torch.rand(B, V, generator=gen) < 0.3)
    rp = torch.tensor([1.0, 1.3, 0.8, 2.0])
    pres = torch.tensor([0.0, 0.5, -0.2, 1.0])
    freq = torch.tensor([0.0, 0.1, 0.3, -0.05])
    before = logits.clone()
    out = ops.apply_penalties(logits, prompt_mask, counts, rp, pres, freq)
    assert torch.equal(logits, before)
    ref = torch.empty(B, V, dtype=torch.float64)
    for b in range(B):
        for i in range(V):
            x = logits[b, i].item()
            c = counts[b, i].item()
            if prompt_mask[b, i] or c > 0:
                x = x / rp[b].item() if x > 0 else x * rp[b].item()
            if c > 0:
                x -= pres[b].item()
            x -= freq[b].item() * c
            ref[b, i] = x
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-6)
    assert torch.equal(out[0], logits[0])  # neutral penalties


def test_opcheck(backend):
    gen = torch.Generator().manual_seed(6)
    args = _mixed_batch(5, 300, gen)
    for n in (3, 0):
        torch.library.opcheck(ops.sample.overload, (*args, n))


def test_greedy_sample_equals_sample_at_temperature_zero():
    # the runtime's all-greedy fast path must be indistinguishable from the op
    B, V = 9, 1000
    logits = torch.randn(B, V)
    logits[0, 10] = logits[0, 500] = logits[0].max() + 1.0  # a tie: lowest index wins in both
    z = torch.zeros(B)
    full = ops.sample(logits, z, torch.zeros(B, dtype=torch.int64), torch.ones(B), z,
                      torch.randint(0, 2**40, (B,)), torch.arange(B), 5)
    fast = ops.greedy_sample(logits, 5)
    for a, b in zip(full, fast):
        assert torch.equal(a, b)
    assert fast[0][0].item() == 10


# --- the fast backend against the reference ----------------------------------------------------

def _pick(gen, B, choices, dtype):
    c = torch.tensor(choices, dtype=dtype)
    return c[torch.randint(0, len(c), (B,), generator=gen)]


def _random_params(B, V, gen):
    """A random mix of parameters per row: greedy, tiny and large temperatures, top-k from 1 to
    beyond V (and -1 / 0 / V), top-p from 0 to just below 1, min-p from 0 to 1."""
    temperature = _pick(gen, B, [0.0, 0.05, 0.7, 1.0, 1.9], torch.float32)
    temperature = torch.where(torch.rand(B, generator=gen) < 0.3, torch.rand(B, generator=gen) * 2, temperature)
    top_k = _pick(gen, B, [-1, 0, 0, 0, 1, 2, 7, 50, 50, min(1500, V), V - 1, V, V + 3, 10 ** 9, min(5000, V - 1)],
                  torch.int64)
    top_p = _pick(gen, B, [1.0, 1.0, 1.0, 0.0, 1e-7, 0.3, 0.9, 0.999, 1 - 1e-7], torch.float32)
    top_p = torch.where(torch.rand(B, generator=gen) < 0.2, torch.rand(B, generator=gen), top_p)
    min_p = _pick(gen, B, [0.0, 0.0, 0.0, 0.01, 0.2, 0.9, 1.0], torch.float32)
    min_p = torch.where(torch.rand(B, generator=gen) < 0.1, torch.rand(B, generator=gen) * 0.3, min_p)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (B,), generator=gen)
    steps = torch.randint(0, 5000, (B,), generator=gen)
    return temperature, top_k, top_p, min_p, seeds, steps


def _lm_logits(B, V, gen):
    """Peaked like a language model's: a Gaussian bulk and a heavy head of 32 tokens per row."""
    lg = torch.randn(B, V, generator=gen) * 2
    head = torch.randint(0, V, (B, 32), generator=gen)
    return lg.scatter_add(1, head, 9 + 3 * torch.randn(B, 32, generator=gen))


def _logits(kind, B, V, gen):
    if kind == "randn":
        return torch.randn(B, V, generator=gen) * 3
    if kind == "lm":
        return _lm_logits(B, V, gen)
    if kind == "bf16":  # coarse values: many ties, also at the K-th candidate
        return (_lm_logits(B, V, gen) * 2).to(torch.bfloat16)
    if kind == "ints":  # thousands of ties per value
        return torch.randint(-3, 3, (B, V), generator=gen).float()
    if kind == "masked":  # most of the vocabulary at -inf (min_tokens, grammar masks)
        lg = torch.randn(B, V, generator=gen) * 4
        lg[torch.rand(B, V, generator=gen) < 0.95] = float("-inf")
        lg[0] = 0.0  # one constant row
        lg[1] = float("-inf")  # one row with a single allowed token
        lg[1, V // 2] = 2.0
        lg[2] = float("-inf")  # one row with none (NaN logprobs; the reference's token is 0)
        return lg
    raise ValueError(kind)


def _assert_same(got, want):
    assert torch.equal(got[0], want[0]), f"tokens differ in rows {torch.nonzero(got[0] != want[0]).flatten().tolist()}"
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0, equal_nan=True)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("kind", ["randn", "lm", "bf16", "ints", "masked"])
@pytest.mark.parametrize("V", [9, 700, 3000, 6000, 20000])  # 6000: K = 1536 candidates, 20000: K = 1024
def test_torch_topk_same_tokens_as_reference(kind, V):
    gen = torch.Generator().manual_seed(V * 7 + len(kind))
    B = 96
    logits = _logits(kind, B, V, gen)
    args = (logits, *_random_params(B, V, gen))
    _assert_same(FAST(*args, 4), REF(*args, 4))
    # a row's outputs are its own: the same alone (other plan, other candidate count)
    for b in (0, 1, 5, 17):
        one = FAST(*(a[b:b + 1] for a in args), 4)
        _assert_same(one, tuple(x[b:b + 1] for x in REF(*args, 4)))


@pytest.mark.parametrize("mix", ["temperature", "top-k 50", "top-p 0.9", "top-k 50 + top-p 0.9", "min-p 0.05",
                                 "top-p 0.9 + min-p 0.05", "top-k 3000"])
def test_planned_path_decides_common_rows_without_the_reference(mix):
    """On language-model-like logits the fast stages decide every row (no redo by the
    reference), and every decided row is the reference's."""
    gen = torch.Generator().manual_seed(11)
    B, V = 24, 40000
    logits = _lm_logits(B, V, gen)
    T, k, p, mp = {"temperature": (0.8, 0, 1.0, 0.0), "top-k 50": (0.8, 50, 1.0, 0.0),
                   "top-p 0.9": (0.8, 0, 0.9, 0.0), "top-k 50 + top-p 0.9": (0.8, 50, 0.9, 0.0),
                   "min-p 0.05": (1.0, 0, 1.0, 0.05), "top-p 0.9 + min-p 0.05": (1.1, 0, 0.9, 0.05),
                   "top-k 3000": (1.0, 3000, 1.0, 0.0)}[mix]
    f = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
    params = (f(T, torch.float32), f(k, torch.int64), f(p, torch.float32), f(mp, torch.float32),
              torch.randint(0, 2 ** 40, (B,), generator=gen), torch.randint(0, 999, (B,), generator=gen))
    plan = sampling.make_plan(*(x.numpy() for x in params[:4]), V)
    out = sampling.sample_planned(logits, *params, 3, plan)
    assert bool(out[4].all()), f"{int((~out[4]).sum())} rows left to the reference"
    _assert_same(out[:4], REF(logits, *params, 3))
    lean = sampling.sample_planned(logits, *params, 0, plan, token_logprobs=False)  # no log-softmax pass
    assert torch.equal(lean[0], out[0]) and lean[2].shape == (B, 0)


def test_plan_classifies_rows():
    V = 10000
    T = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]
    k = [0, 0, 50, 0, 5000, V, 0, 4095]
    p = [1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.5]
    mp = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0]
    plan = sampling.make_plan(T, k, p, mp, V)
    assert plan.full_rows == (1, 5, 6) and plan.full_minp  # temperature / min-p only (k = V is no top-k)
    assert plan.ref_rows == (4,)  # top-k between the candidate bound and V
    assert plan.candidates == 4096 and plan.full_norm and plan.any_greedy and not plan.complete
    assert sampling.make_plan([0.0, 0.0], [5, 0], [1.0, 0.3], [0.0, 0.0], V) == sampling.SamplePlan(
        0, False, (), False, (), True, True)
    small = sampling.make_plan([1.0], [0], [0.9], [0.0], 500)  # candidates cover a small vocabulary
    assert small.candidates == 500 and small.complete and not small.full_norm
    # host values are compared as the device's float32: top_p = 1 - 1e-9 is 1.0 there
    assert sampling.make_plan([1.0], [0], [1 - 1e-9], [0.0], V).full_rows == (0,)


def test_escaping_top_p_rows_are_flagged_and_redone():
    """Flat logits: top-p 0.99 keeps far more than the candidates. The planned path flags those
    rows (or proves the winner by the Gumbel bound); the op backend redoes them."""
    gen = torch.Generator().manual_seed(12)
    B, V = 16, 30000
    logits = torch.randn(B, V, generator=gen)
    logits[3, 7] = 60.0  # a row whose winner beats anything outside the candidates
    f = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
    params = (f(1.0, torch.float32), f(0, torch.int64), f(0.99, torch.float32), f(0.0, torch.float32),
              torch.arange(B), torch.zeros(B, dtype=torch.int64))
    plan = sampling.make_plan(*(x.numpy() for x in params[:4]), V)
    out = sampling.sample_planned(logits, *params, 0, plan)
    want = REF(logits, *params, 0)
    ex = out[4]
    assert bool(ex[3]) and int(ex.sum()) < B
    assert torch.equal(out[0][ex], want[0][ex])
    _assert_same(FAST(logits, *params, 0), want)


def _exact_tie(li, gi, gj):
    """(li', x) with li' + gi == x + gj exactly in fp32 and x != li'. Not every sum is reachable
    (x may have a coarser ulp than the sum), so li is nudged until one is."""
    up = torch.tensor(float("inf"), device=li.device)
    for _ in range(64):
        target = li + gi
        x = target - gj
        for _ in range(64):
            s = x + gj
            if s == target:
                break
            x = torch.nextafter(x, up if s < target else -up)
        if x + gj == target and x != li:
            return li, x
        li = torch.nextafter(li, up)
    raise AssertionError("no exact tie found")


def test_full_pass_breaks_noisy_ties_like_the_reference(monkeypatch):
    """Two tokens with the same logit + noise, in different column chunks: the reference takes
    the one with the larger logit (sorted first), not the lower index."""
    monkeypatch.setattr(sampling, "_CPU_CHUNK_ELEMS", 1024)
    monkeypatch.setattr(sampling, "_CPU_CHUNK_MIN", 1024)
    V = 5000
    seeds, steps = torch.tensor([77]), torch.tensor([5])
    g = -torch.log(-torch.log(uniform_noise(seeds, steps, V)))[0]
    i, j = 100, 4000  # chunks 0 and 3
    li, x = _exact_tie(torch.tensor(3.0), g[i], g[j])
    logits = torch.full((1, V), -50.0)
    logits[0, i] = li
    logits[0, j] = x
    params = (torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1), seeds, steps)
    want = REF(logits, *params, 0)[0]
    assert want.item() == (i if logits[0, i] > x else j)
    assert FAST(logits, *params, 0)[0].item() == want.item()
    assert sampling._gumbel_argmax(logits, seeds, steps).item() == want.item()


def test_gumbel_bound_covers_the_noise():
    # the largest u the noise can give, through the same float32 ops as the samplers
    u_max = torch.tensor([(2 ** 24 - 1) * 2.0 ** -24], dtype=torch.float32)
    assert (-torch.log(-torch.log(u_max))).item() < sampling._G_BOUND
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert (-torch.log(-torch.log(u))).max().item() < sampling._G_BOUND


def test_redo_tries_more_candidates_before_the_reference(monkeypatch):
    """Flat logits, top-p 0.9: the kept set (~2000 tokens) escapes 1024 candidates but not 16384;
    the redo decides the rows there, without the full sort."""
    gen = torch.Generator().manual_seed(13)
    B, V = 6, 50000
    logits = torch.randn(B, V, generator=gen) * 3
    f = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
    params = (f(1.0, torch.float32), f(0, torch.int64), f(0.9, torch.float32), f(0.0, torch.float32),
              torch.arange(B), torch.zeros(B, dtype=torch.int64))
    want = REF(logits, *params, 2)
    plan = sampling.make_plan(*(x.numpy() for x in params[:4]), V)
    out = sampling.sample_planned(logits, *params, 2, plan)
    assert not bool(out[4].any())

    def no_sort(*a):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(sampling, "_sample_ref", no_sort)
    sampling.redo_rows(out, list(range(B)), logits, *params)
    assert bool(out[4].all())
    _assert_same(out[:4], want)


# --- candidate columns: a row's candidate set sampled on its own columns ----------------------------
@pytest.mark.parametrize("kind", ["randn", "lm", "bf16", "ints"])
@pytest.mark.parametrize("V,M", [(700, 40), (6000, 1100), (20000, 4097)])
def test_candidate_columns_same_tokens_as_the_whole_vocabulary(kind, V, M):
    """Each row's M candidates (random ids, ascending, the last few rows padded with -1): the
    columns sampled with col_ids give the reference's tokens over the whole vocabulary with every
    other logit -inf (the noise is keyed on the id, the ties broken by the lower id)."""
    gen = torch.Generator().manual_seed(V + M + len(kind))
    B = 64
    temperature, top_k, top_p, min_p, seeds, steps = _random_params(B, V, gen)
    full = _logits(kind, B, V, gen).float()
    col_ids = torch.stack([torch.randperm(V, generator=gen)[:M].sort().values for _ in range(B)])
    col_ids[-4:, M - 5:] = -1  # padding
    cols = full.gather(1, col_ids.clamp_min(0)).masked_fill(col_ids < 0, float("-inf"))
    wide = torch.full_like(full, float("-inf"))  # the same row over the whole vocabulary
    for b in range(B):
        keep = col_ids[b][col_ids[b] >= 0]
        wide[b, keep] = full[b, keep]
    plan = sampling.whole_row_plan(M, bool((temperature <= 0).any()))
    got = sampling.sample_planned(cols, temperature, top_k, top_p, min_p, seeds, steps, 0, plan,
                                  token_logprobs=False, col_ids=col_ids)
    assert bool(got[4].all())  # the whole row: every row decided
    tokens = col_ids.gather(1, got[0].unsqueeze(1)).squeeze(1)
    want = REF(wide, temperature, top_k, top_p, min_p, seeds, steps, 0)[0]
    assert torch.equal(tokens, want), f"rows {torch.nonzero(tokens != want).flatten().tolist()}"
    with pytest.raises(ValueError, match="col_ids"):
        sampling.sample_planned(cols, temperature, top_k, top_p, min_p, seeds, steps, 2, plan, col_ids=col_ids)
