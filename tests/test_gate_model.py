"""mstar.bench.gate_model (the trained checkpoint for the gate), at a tiny size on the CPU: the
task's data follow its rule; a model trained for a few steps and saved as the module saves it
(bf16 safetensors, tokenizer, gate_task.json) loads in mstar and in transformers with the same
fp32 logits, through prefill and decode. The full-size run (minutes):
`python -m mstar.bench.gate_model --out .gate_model`."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from hf_models import TOL, check_prefill_then_decode

from mstar.bench import gate_model as gm

VOCAB = 300
# per-head shapes much smaller than the preset's (the real run keeps head_dim 256, GDN 16 x 128)
SMALL_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}


@pytest.mark.parametrize("rule, lag", [("copy", 3), ("perm", 2), ("perm", 5)])
def test_batches_follow_the_rule(rule, lag):
    task = gm.PermLagTask.from_seed(VOCAB, lag, seed=3, rule=rule)
    assert sorted(task.perm.tolist()) == list(range(VOCAB))
    if rule == "perm":
        assert not (task.perm == torch.arange(VOCAB)).any()  # a derangement: no token repeats itself
    x, y = task.batch(torch.Generator().manual_seed(11), 16, 60)
    assert x.shape == y.shape == (16, 60) and 0 <= int(x.min()) and int(x.max()) < VOCAB
    x2, y2 = task.batch(torch.Generator().manual_seed(11), 16, 60)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # deterministic for a seed
    assert (y[:, :lag - 1] == gm.IGNORE).all()
    follows = 0
    for r in range(16):
        row = x[r].tolist()
        # every label from position lag - 1 on is the rule's next token after the context
        assert y[r, lag - 1:].tolist() == [task.next_token(row[:n]) for n in range(lag, 61)]
        # the row is random ids, then follows the rule to its end
        ok = [row[j] == task.next_token(row[:j]) for j in range(lag, 60)]
        tail = len(ok) - next((i for i, v in enumerate(reversed(ok)) if not v), len(ok))
        follows += len(ok) - tail
    # about half of all positions follow the rule (random cut); random ids would almost never
    assert 0.2 < follows / (16 * (60 - lag)) < 0.8
    # fresh random inputs (none of them following the rule): labels are still the rule's
    z = torch.randint(0, VOCAB, (4, 30), generator=torch.Generator().manual_seed(5))
    lab = task.labels(z)
    for r in range(4):
        assert lab[r, lag - 1:].tolist() == [int(task.perm[z[r, n - lag]]) for n in range(lag, 31)]
    assert task.continue_([1, 2, 3, 4, 5], 7) == [task.next_token(s) for s in _prefixes([1, 2, 3, 4, 5], task, 7)]


def _prefixes(ctx, task, n):
    seq = list(ctx)
    for _ in range(n):
        yield list(seq)
        seq.append(task.next_token(seq))


def test_trained_checkpoint_loads_in_mstar_and_hf_with_the_same_logits(tmp_path):
    from mstar.models import load_model, load_tokenizer
    config = gm.model_config(vocab=VOCAB, hidden=64, intermediate=128, layers=4, **SMALL_HEADS)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    model = gm.make_model(config, seed=0)
    task = gm.PermLagTask.from_seed(VOCAB, 3, seed=0)
    logs = []
    stats = gm.train(model, task, steps=4, seed=0, lr=3e-3, warmup=2, tokens_per_step=160, min_len=8, max_len=40,
                     log_every=2, log=logs.append)
    assert len(stats["losses"]) == 4 and all(math.isfinite(v) for v in stats["losses"]) and logs
    gm.save(model, task, str(tmp_path), torch.bfloat16, {"train": stats})
    assert gm.PermLagTask.load(str(tmp_path)).perm.tolist() == task.perm.tolist()
    tok = load_tokenizer(str(tmp_path))
    assert len(tok) == VOCAB

    hf = gm.load_hf(str(tmp_path), torch.float32)  # both sides: the bf16-rounded weights, in fp32
    ours = load_model(str(tmp_path), dtype=torch.float32, progress=False)
    # relative tolerance TOL (max |mstar - HF| / max |HF logit|) over every position; 70 > 64: a
    # multi-chunk GDN prefill
    assert TOL == 1e-4
    check_prefill_then_decode(hf, ours, lengths=[5, 70, 1], decode_steps=4, vocab=VOCAB)

    ev = gm.evaluate(hf, task, num_prompts=4, prompt_len=(8, 20), tokens=4, seed=1)
    assert 0.0 <= ev["follow_frac"] <= 1.0 and ev["first_margin_min"] <= ev["first_margin_p5"]
