"""Sampler: per-row parameters gathered by row, incremental penalty state, min_tokens
masking, logprobs, batch-independence of seeded draws, and its planned (sync-free) path against
the reference op."""

from __future__ import annotations

import pytest
import torch

from mstar import knobs, ops
from mstar.ops import sampling
from mstar.runtime.engine.request import SamplingParams
from mstar.runtime.engine.sampler import Sampler

V = 50


def logits_for(B, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_row_params():
    s = Sampler(8, V, "cpu")
    r_greedy = s.add(SamplingParams(temperature=0.0), 1, [1, 2], [])
    r_hot = s.add(SamplingParams(temperature=1.0, top_k=5, seed=3), 3, [1], [])
    lg = logits_for(2)
    res = s.sample(lg.clone(), [r_greedy, r_hot], [0, 4])
    assert res.tokens[0] == int(lg[0].argmax())
    ref = ops.sample(lg[1:].clone(), torch.tensor([1.0]), torch.tensor([5]), torch.tensor([1.0]), torch.tensor([0.0]),
                     torch.tensor([3]), torch.tensor([4]), 0)[0]
    assert res.tokens[1] == int(ref[0])
    assert res.logprobs is None


def test_seeded_draw_independent_of_batch_and_row():
    s = Sampler(8, V, "cpu")
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    rows = [s.add(SamplingParams(temperature=0.7, seed=i), i, [], []) for i in range(5)]
    target = s.add(p, 11, [], [])
    lg = logits_for(6, seed=5)
    big = s.sample(lg.clone(), rows + [target], [3, 1, 4, 1, 5, 9]).tokens[-1]
    s2 = Sampler(8, V, "cpu")
    s2.add(SamplingParams(), 0, [], [])
    t2 = s2.add(p, 11, [], [])
    alone = s2.sample(lg[-1:].clone(), [t2], [9]).tokens[0]
    assert big == alone


def test_penalties_incremental_state_matches_rebuild():
    s = Sampler(4, V, "cpu")
    prompt = [1, 2, 3, 3]
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    plain = s.add(SamplingParams(temperature=0.0), 0, prompt, [])
    row = s.add(p, 0, prompt, [])
    out: list[int] = []
    for step in range(6):
        lg = logits_for(2, seed=step)
        res = s.sample(lg.clone(), [plain, row], [step, step])
        # reference: penalties from the full history, rebuilt from scratch
        pm = torch.zeros(1, V, dtype=torch.bool)
        pm[0, prompt] = True
        cnt = torch.zeros(1, V, dtype=torch.int32)
        for t in out:
            cnt[0, t] += 1
        pen = ops.apply_penalties(lg[1:].clone(), pm, cnt, torch.tensor([1.5]), torch.tensor([0.5]),
                                  torch.tensor([0.3]))
        assert res.tokens[1] == int(pen[0].argmax())
        assert res.tokens[0] == int(lg[0].argmax())  # the unpenalised row is untouched
        out.append(res.tokens[1])
        cnt[0, out[-1]] += 1
        assert torch.equal(s.output_counts[row], cnt[0])  # updated by the sampler itself
    # a row re-added with history (recompute after preemption) gets the same state
    s.release(row)
    row2 = s.add(p, 0, prompt, out)
    assert torch.equal(s.output_counts[row2], cnt[0])
    assert torch.equal(s.prompt_mask[row2], pm[0])


def test_penalty_tensors_lazy():
    s = Sampler(4, V, "cpu")
    s.add(SamplingParams(), 0, [1], [])
    assert s.output_counts is None and s.prompt_mask is None


def test_masked_ids_and_logprobs():
    s = Sampler(4, V, "cpu")
    a = s.add(SamplingParams(temperature=0.0, logprobs=3), 0, [], [])
    b = s.add(SamplingParams(temperature=0.0), 0, [], [])
    c = s.add(SamplingParams(temperature=0.0, logprobs=0), 0, [], [])
    lg = logits_for(3, seed=9)
    top = lg.argsort(dim=-1, descending=True)
    res = s.sample(lg.clone(), [a, b, c], [0, 0, 0], masked=[(1, [int(top[1, 0]), int(top[1, 1]), 10_000])])
    assert res.tokens[1] == int(top[1, 2])
    assert res.tokens[0] == int(top[0, 0])
    lp = res.logprobs
    assert lp[1] is None
    assert len(lp[0].top_ids) == 3 and lp[0].top_ids[0] == res.tokens[0]
    ref = torch.log_softmax(lg[0], -1)
    assert abs(lp[0].logprob - float(ref[res.tokens[0]])) < 1e-5
    assert lp[2].top_ids == [] and abs(lp[2].logprob - float(torch.log_softmax(lg[2], -1).max())) < 1e-5


def test_rows_are_recycled():
    s = Sampler(2, V, "cpu")
    r = [s.add(SamplingParams(), 0, [], []) for _ in range(2)]
    assert s.num_free == 0
    s.release(r[0])
    s.release(-1)  # a sequence without a row: ignored
    assert s.num_free == 1
    assert s.add(SamplingParams(), 0, [], []) == r[0]


def _mixed_sampler(V):
    s = Sampler(16, V, "cpu")
    plist = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, seed=1),
             SamplingParams(temperature=0.8, top_k=50, logprobs=1), SamplingParams(temperature=0.8, top_p=0.9),
             SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.0, top_p=0.99, logprobs=3),
             SamplingParams(temperature=0.7, top_k=4500), SamplingParams(temperature=1.2, top_k=7, top_p=0.5,
                                                                        min_p=0.1, repetition_penalty=1.3)]
    rows = [s.add(p, 100 + i, [1, 2, 3], []) for i, p in enumerate(plist)]
    return s, rows


def test_planned_path_equals_the_reference_op():
    """The Sampler's own plan (no sync) against `MSTAR_BACKENDS=sample=reference`, over steps, with
    rows the fast stages leave to the reference (flat logits under top-p 0.99) and penalties."""
    V = 6000
    fast, rows = _mixed_sampler(V)
    ref, rows_r = _mixed_sampler(V)
    assert rows == rows_r
    gen = torch.Generator().manual_seed(3)
    redone = 0
    for step in range(4):
        lg = torch.randn(len(rows), V, generator=gen) * 2
        lg[:, :40] += 9  # a peaked head for most rows
        lg[5] = torch.randn(V, generator=gen)  # flat: top-p 0.99 keeps far more than the candidates
        plan = sampling.make_plan(fast._fhost[0, rows], fast._top_k[rows], fast._fhost[1, rows], fast._fhost[2, rows], V)
        assert plan.ref_rows == (6,) and not plan.complete
        out = sampling.sample_planned(lg.clone(), *_row_params(fast, rows, step), 0, plan)
        redone += int((~out[4]).sum())
        got = fast.sample(lg.clone(), rows, [step] * len(rows))
        with knobs.override(MSTAR_BACKENDS="sample=reference"):
            want = ref.sample(lg.clone(), rows, [step] * len(rows))
        assert got.tokens == want.tokens
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-5
        assert torch.equal(fast.output_counts, ref.output_counts)  # counted with the final tokens
    assert redone >= 1  # the redo path ran


def _row_params(s, rows, step):
    r = torch.tensor(rows)
    return (s.fparams[0, r], s.iparams[0, r], s.fparams[1, r], s.fparams[2, r], s.iparams[1, r],
            torch.full((len(rows),), step, dtype=torch.int64))


def test_verify_mode_goes_through_the_op():
    s, rows = _mixed_sampler(V)
    ops.reset_verify_report()
    with knobs.override(MSTAR_VERIFY=True):
        s.sample(logits_for(len(rows), seed=4), rows, [0] * len(rows))
    rep = ops.verify_report()
    assert rep["sample"]["calls"] == 1 and rep["sample"]["max_abs_diff"] == 0.0


def test_candidate_columns_equal_the_masked_vocabulary():
    """sample / sample_device on candidate columns (col_ids) against the same rows over the whole
    vocabulary with every other logit -inf: the same tokens, the same penalty counts after."""
    Vw, M, B = 300, 40, 6
    gen = torch.Generator().manual_seed(17)
    plist = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=1),
             SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5, seed=3),
             SamplingParams(temperature=0.9, min_p=0.1, frequency_penalty=0.4, presence_penalty=0.2, seed=4),
             SamplingParams(temperature=1.3, seed=5), SamplingParams(temperature=0.6, top_p=0.8, seed=6)]

    def make():
        s = Sampler(8, Vw, "cpu")
        return s, [s.add(p, 7 + i, [int(x) for x in torch.randint(0, Vw, (5,), generator=torch.Generator()
                                                                     .manual_seed(i))], []) for i, p in enumerate(plist)]

    wide_s, rows = make()
    cols_s, rows_c = make()
    dev_s, rows_d = make()
    assert rows == rows_c == rows_d
    for step in range(12):
        col_ids = torch.stack([torch.randperm(Vw, generator=gen)[:M].sort().values for _ in range(B)])
        col_ids[0, -3:] = -1
        full = torch.randn(B, Vw, generator=gen) * 3
        cols = full.gather(1, col_ids.clamp_min(0)).masked_fill(col_ids < 0, float("-inf"))
        wide = torch.full_like(full, float("-inf"))
        for b in range(B):
            keep = col_ids[b][col_ids[b] >= 0]
            wide[b, keep] = full[b, keep]
        steps = [step] * B
        want = wide_s.sample(wide.clone(), rows, steps).tokens
        got = cols_s.sample(cols.clone(), rows, steps, col_ids=col_ids).tokens
        on_dev = dev_s.sample_device(cols.clone(), rows, steps, col_ids=col_ids).tolist()
        assert got == want == on_dev, step
        assert all(t in col_ids[b].tolist() for b, t in enumerate(got))
    assert torch.equal(cols_s.output_counts, wide_s.output_counts)
    assert torch.equal(dev_s.output_counts, wide_s.output_counts)
    logprob_row = cols_s.add(SamplingParams(temperature=1.0, logprobs=2), 9, [], [])
    with pytest.raises(ValueError, match="logprobs"):
        cols_s.sample(cols[:1].clone(), [logprob_row], [0], col_ids=col_ids[:1])
