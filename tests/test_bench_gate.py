"""The correctness gate (`python -m mstar.bench.gate`) at tiny sizes on the CPU in fp32:
complete agreement with HF transformers, the JSON record, and exit status 1 once an mstar weight
is perturbed. The GPU run (bf16, real shapes): see the module docstring."""

from __future__ import annotations

import json

import pytest
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture

from mstar.bench import gate

SMALL = ["--device", "cpu", "--dtype", "float32", "--num-prompts", "6", "--prompt-len", "8", "64",
         "--max-tokens", "6"]
TOP_FIELDS = {"bench", "model", "dtype", "device", "gpu", "commit", "date", "num_prompts", "prompt_len",
              "max_tokens", "batch_sizes", "tie_tol", "logprob_tol", "logprob_hf_factor", "logprob_positions",
              "logprob_top", "levels", "fixed_8", "stop", "backends", "pass"}
LEVEL_FIELDS = {"n", "num_prompts", "exact_match", "first_token_agree", "first_token_agree_with_ties",
                "mean_common_prefix", "diverged", "near_ties", "max_gap", "divergences", "first_vs_fp32",
                "mstar_wall_s", "hf_wall_s", "logprob", "pass"}
LOGPROB_FIELDS = {"max_diff", "prompt", "pos", "token", "mstar", "referee", "max_diff_by_pos", "checked", "tol",
                  "tol_floor", "hf_max_diff", "pass"}


@pytest.mark.parametrize("model, extra", [("tiny-qwen3.5", []), ("tiny-qwen3", ["--hf-single"])])
def test_gate_passes_in_fp32(model, extra, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    out = tmp_path / "gate.json"
    rc = gate.main(["--model", model, *SMALL, "--batch-sizes", "1", "4", "--strict", *extra, "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "GATE PASS" in printed
    r = json.loads(out.read_text())
    assert TOP_FIELDS <= set(r)
    assert r["pass"] and r["strict"] and r["commit"] == "abc1234" and r["dtype"] == "float32"
    assert r["device"] == "cpu" and r["model"] == model and r["batch_sizes"] == [1, 4]
    assert [lv["n"] for lv in r["levels"]] == [1, 4]
    assert r["hf_single"] == bool(extra) and [lv["hf_batch"] for lv in r["levels"]] == ([1, 1] if extra else [1, 4])
    for lv in r["levels"]:
        assert LEVEL_FIELDS <= set(lv)
        assert lv["exact_match"] == lv["first_token_agree"] == 6, lv
        assert lv["diverged"] == 0 and lv["mean_common_prefix"] == 6.0
        assert lv["first_vs_fp32"]["mstar"]["agree"] == 6
        assert lv["mstar_wall_s"] > 0 and lv["hf_wall_s"] > 0 and lv["pass"]
        lp = lv["logprob"]
        assert LOGPROB_FIELDS <= set(lp) and lp["pass"] and lp["checked"] == 6 * r["logprob_positions"]
        assert lp["max_diff"] < r["logprob_tol"] / 10  # fp32 on the CPU: ~1e-5
    f8 = r["fixed_8"]
    assert f8["pass"] and f8["all_len_8"] and f8["exact_match"] == 6
    st = r["stop"]
    assert st["pass"] and st["stop_string"]["pass"] and st["stop_token"]["pass"]
    assert st["stop_string"]["stop"] and len(st["stop_string"]["runs"]) == 2


def test_gate_fails_when_an_mstar_weight_is_perturbed(tmp_path, capsys):
    out = tmp_path / "gate.json"
    rc = gate.main(["--model", "tiny-qwen3.5", *SMALL, "--batch-sizes", "4",
                    "--perturb-weight", "model.layers.0.mlp.down_proj.weight", "--out", str(out)])
    assert rc == 1
    assert "GATE FAIL" in capsys.readouterr().out
    r = json.loads(out.read_text())
    (lv,) = r["levels"]
    assert not r["pass"] and not lv["pass"] and not r["fixed_8"]["pass"]
    assert lv["first_token_agree"] < 6 and lv["near_ties"] < lv["diverged"]
    assert lv["max_gap"] > 1.0  # the referee ranks the perturbed model's tokens far down
    assert not lv["logprob"]["pass"] and lv["logprob"]["max_diff"] > 10 * r["logprob_tol"]


class _FakeHF:
    """gap(): token 7 is a near-tie, every other disagreeing token far down."""

    def gap(self, ids, token):
        return 0.0 if token in (5, 6) else (0.2 if token == 7 else 3.0)


def test_compare_counts_near_ties():
    prompts = [[1], [2], [3]]
    ref = [[6, 1], [5, 5], [6, 6]]
    got = [[7, 1], [5, 5], [6, 9]]  # a near-tie first token; equal; a far-down second token
    c = gate.compare(prompts, got, ref, _FakeHF(), tie_tol=0.5, want_len=2)
    assert (c["exact_match"], c["first_token_agree"], c["first_token_agree_with_ties"]) == (1, 2, 3)
    assert (c["diverged"], c["near_ties"], c["max_gap"]) == (2, 1, 3.0)
    assert c["mean_common_prefix"] == pytest.approx(1.0)
    assert [(d["prompt"], d["pos"], d["near_tie"]) for d in c["divergences"]] == [(0, 0, True), (2, 1, False)]
    assert not gate._level_pass(c, strict=False)
    c2 = gate.compare(prompts[:2], got[:2], ref[:2], _FakeHF(), tie_tol=0.5, want_len=2)
    assert gate._level_pass(c2, strict=False) and not gate._level_pass(c2, strict=True)
    c3 = gate.compare(prompts[:2], [[7], [5, 5]], ref[:2], _FakeHF(), tie_tol=0.5, want_len=2)
    assert c3["wrong_length"] == [{"prompt": 0, "len": 1}] and not gate._level_pass(c3, strict=False)


def test_synthetic_tokenizer():
    tok = gate.synthetic_tokenizer(1000, [998, 996])
    assert len(tok) == 1000
    assert tok.convert_ids_to_tokens([998, 996]) == ["<|im_end|>", "<|endoftext|>"]
    assert tok.eos_token_id == 998 and tok.pad_token_id == 996
    text = tok.decode([300, 998, 301, 72], skip_special_tokens=True)
    assert text.isascii() and text.isprintable() and text.endswith("H") and len(text) == 5
    assert tok.decode(tok.encode("héllo!")) == "héllo!"
