"""The gate's logprob check (mstar.bench.gate.logprob_check): mstar's logprobs at its token and
top ids against the fp32 referee's log_softmax of the same context. A unit test on made-up
numbers, and the gate at tiny sizes on the CPU in fp32: the unperturbed model passes it, a
perturbed weight fails it, also where every token still equals HF's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture

from mstar.bench import gate
from mstar.runtime.engine.request import TokenLogprobs

V = 8


class _FakeHF:
    """next_logits: logits whose log_softmax is known; one vector per context length."""

    def next_logits(self, ids):
        g = torch.Generator().manual_seed(len(ids))
        return torch.randn(V, generator=g) * 3


def _lp(hf, ctx, token, top, shift=None):
    """TokenLogprobs as an exact engine would give them (the referee's), `shift` {id: delta} added."""
    ref = torch.log_softmax(hf.next_logits(ctx).double(), -1)
    shift = shift or {}
    ids = torch.topk(ref, top).indices.tolist()
    return TokenLogprobs(float(ref[token]) + shift.get(token, 0.0), ids,
                         [float(ref[t]) + shift.get(t, 0.0) for t in ids])


def test_logprob_check_counts_the_largest_difference():
    hf = _FakeHF()
    prompts = [[1, 2], [3, 4, 5]]
    ref = [[6, 1, 2], [7, 7, 0]]
    toks = [[6, 1, 3], [7, 0, 0]]  # prompt 0 agrees with HF for 2 tokens, prompt 1 for 1
    lps = [[_lp(hf, prompts[0] + toks[0][:j], toks[0][j], 3) for j in range(3)],
           [_lp(hf, prompts[1] + toks[1][:j], toks[1][j], 3) for j in range(3)]]
    exact = gate.logprob_check(prompts, toks, lps, ref, hf, positions=4, tol=1e-3)
    # positions while the tokens before them are HF's: 0, 1, 2 of prompt 0; 0, 1 of prompt 1
    assert exact["checked"] == 5 and exact["pass"] and exact["max_diff"] < 1e-6
    assert gate.logprob_check(prompts, toks, lps, ref, hf, positions=1, tol=1e-3)["checked"] == 2

    # a wrong logprob at a listed id, at prompt 1 position 1: found, with where it is
    lps[1][1] = _lp(hf, prompts[1] + toks[1][:1], toks[1][1], 3, shift={toks[1][1]: -0.25})
    c = gate.logprob_check(prompts, toks, lps, ref, hf, positions=4, tol=0.1)
    assert not c["pass"] and c["max_diff"] == pytest.approx(0.25, abs=1e-6)
    assert (c["prompt"], c["pos"], c["token"], c["listed"]) == (1, 1, toks[1][1], True)
    assert c["mstar"] == pytest.approx(c["referee"] - 0.25, abs=1e-5)
    assert gate.logprob_check(prompts, toks, lps, ref, hf, positions=4, tol=0.3)["pass"]
    # beyond the positions checked it is not seen
    assert gate.logprob_check(prompts, toks, lps, ref, hf, positions=1, tol=0.1)["pass"]

    # the referee's best id missing from mstar's list, which lists the others above it
    ctx = prompts[0]
    refv = torch.log_softmax(hf.next_logits(ctx).double(), -1)
    order = torch.argsort(refv, descending=True).tolist()
    ids = order[1:4]
    lps[0][0] = TokenLogprobs(float(refv[ids[0]]), ids, [float(refv[t]) for t in ids])
    c = gate.logprob_check(prompts, [[ids[0], 1, 3], toks[1]], lps, ref, hf, positions=1, tol=0.1)
    bound = float(refv[order[0]] - refv[ids[-1]])
    assert not c["pass"] and c["max_diff"] == pytest.approx(bound, abs=1e-5)
    assert (c["prompt"], c["pos"], c["token"], c["listed"]) == (0, 0, order[0], False)

    # no logprobs at all: fails
    none = gate.logprob_check(prompts, toks, [None, []], ref, hf, positions=4, tol=1.0)
    assert none["checked"] == 0 and not none["pass"]


class _FakeLLM:
    """generate: HF's tokens with the referee's logprobs, `shift` added to every listed value."""

    def __init__(self, hf, ref, shift):
        self.hf, self.ref, self.shift = hf, ref, shift
        self.resets = 0
        self.engine = self

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, prompts, params):
        assert params.logprobs == gate.LOGPROB_TOP and params.temperature == 0.0
        outs = []
        for p, r in zip(prompts, self.ref):
            t = r[:params.max_tokens]
            lps = []
            for j in range(len(t)):
                e = _lp(self.hf, p + t[:j], t[j], 3)
                lps.append(TokenLogprobs(e.logprob + self.shift, e.top_ids, [v + self.shift for v in e.top_logprobs]))
            outs.append(SimpleNamespace(token_ids=t, logprobs=lps))
        return outs


class _FakeHFOwn(_FakeHF):
    """As _FakeHF, with HF's own logprobs `own` away from the referee's; HF is not the referee."""

    model, referee, cpu = object(), object(), True

    def __init__(self, own):
        self.own = own

    def own_logprobs(self, ids, token, top):
        e = _lp(self, ids, token, min(top, V))
        return TokenLogprobs(e.logprob - self.own, e.top_ids, [v - self.own for v in e.top_logprobs])


@pytest.mark.parametrize("shift, own, tol, factor, want_tol, ok", [
    (0.2, 0.1, 0.25, 2.5, 0.25, True),    # the floor
    (0.3, 0.1, 0.25, 2.5, 0.25, False),
    (0.3, 0.2, 0.25, 2.5, 0.5, True),     # HF itself as far off: 2.5 x HF's
    (0.6, 0.2, 0.25, 2.5, 0.5, False),
    (0.3, 0.2, 0.25, 0.0, 0.25, False),   # factor 0: the floor alone
])
def test_check_logprobs_tolerance_is_floor_or_hf_multiple(shift, own, tol, factor, want_tol, ok):
    hf = _FakeHFOwn(own)
    prompts, ref = [[1, 2], [3]], [[4, 5, 6], [7, 0, 1]]
    llm = _FakeLLM(hf, ref, shift)
    c = gate.check_logprobs(llm, prompts, ref, hf, positions=2, tol=tol, hf_factor=factor)
    assert llm.resets == 1 and c["checked"] == 4
    assert c["max_diff"] == pytest.approx(shift, abs=1e-5) and c["hf_max_diff"] == pytest.approx(own, abs=1e-5)
    assert c["tol"] == pytest.approx(want_tol, abs=1e-5) and c["tol_floor"] == tol and c["pass"] == ok
    # HF as the referee (fp32 on the CPU): no yardstick, the floor alone
    hf.model = hf.referee
    c = gate.check_logprobs(llm, prompts, ref, hf, positions=2, tol=tol, hf_factor=factor)
    assert c["hf_max_diff"] is None and c["tol"] == tol and c["pass"] == (shift <= tol)


SMALL = ["--device", "cpu", "--dtype", "float32", "--num-prompts", "6", "--prompt-len", "8", "64",
         "--max-tokens", "6"]


def _gate(tmp_path, capsys, *extra):
    out = tmp_path / "gate.json"
    rc = gate.main(["--model", "tiny-qwen3.5", *SMALL, *extra, "--out", str(out)])
    return rc, capsys.readouterr().out, json.loads(out.read_text())


def test_unperturbed_passes_the_logprob_check(tmp_path, capsys):
    rc, printed, r = _gate(tmp_path, capsys, "--batch-sizes", "1", "4", "--strict")
    assert rc == 0 and "GATE PASS" in printed, printed
    tol = gate.DEFAULT_LOGPROB_TOL[torch.float32]
    assert r["logprob_tol"] == tol and r["logprob_positions"] == 4 and r["logprob_top"] == gate.LOGPROB_TOP
    for lv in r["levels"]:
        lp = lv["logprob"]
        # fp32 on the CPU: HF is the referee, the tolerance is the floor
        assert lp["hf_max_diff"] is None and lp["tol"] == tol
        assert lp["pass"] and lp["checked"] == 6 * 4 and 0 <= lp["max_diff"] < tol / 10, lp
        assert len(lp["max_diff_by_pos"]) == 4 and max(lp["max_diff_by_pos"]) == lp["max_diff"]


def test_perturbed_weight_fails_the_logprob_check(tmp_path, capsys):
    rc, printed, r = _gate(tmp_path, capsys, "--batch-sizes", "4", "--perturb-weight", "model.norm.weight")
    assert rc == 1 and "GATE FAIL" in printed and "logprob: prompt" in printed
    (lv,) = r["levels"]
    assert not lv["pass"] and not lv["logprob"]["pass"]
    assert lv["logprob"]["max_diff"] > 10 * r["logprob_tol"]


def test_small_perturbation_caught_by_logprobs_alone(tmp_path, capsys, monkeypatch):
    """A weight change too small to move any greedy token (the final norm's weights + 0.1, its
    outputs about 10% larger; measured: max |diff| 0.05, 5x the fp32 tolerance): the token
    counts pass, the level fails on its logprobs alone."""
    def nudge(llm, name, seed):
        p = dict(llm.engine.model.named_parameters())[name]
        with torch.no_grad():
            p.add_(0.1)
    monkeypatch.setattr(gate, "perturb", nudge)
    rc, printed, r = _gate(tmp_path, capsys, "--batch-sizes", "4", "--strict", "--perturb-weight", "model.norm.weight")
    assert rc == 1 and "GATE FAIL" in printed
    (lv,) = r["levels"]
    assert lv["exact_match"] == lv["first_token_agree"] == 6 and lv["diverged"] == 0
    assert r["fixed_8"]["pass"] and r["stop"]["pass"]
    assert not lv["pass"] and not lv["logprob"]["pass"] and lv["logprob"]["max_diff"] > 2 * r["logprob_tol"]
    # the same run without the check passes
    rc, printed, r = _gate(tmp_path, capsys, "--batch-sizes", "4", "--strict", "--logprob-positions", "0",
                           "--perturb-weight", "model.norm.weight")
    assert rc == 0 and "logprob tol off" in printed and "logprob" not in r["levels"][0]
