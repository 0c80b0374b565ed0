"""The step and VAE profilers (mstar/bench/tools/profile_dit.py, profile_vae.py) on CPU with tiny
models: Cosmos3's step FLOPs against torch's FLOP counter, both profilers' output, and the VAE
profiler's records (one per dtype and layout, the float32 ones the same video)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mstar.bench import video as B
from mstar.bench.tools import profile_dit, profile_vae
from mstar.models.cosmos3 import rope
from mstar.models.cosmos3.family import _make_config, random_transformer
from mstar.models.cosmos3.presets import get


@pytest.mark.parametrize("prompt_len,frames,rows", [(7, 2, 1), (3, 1, 2), (12, 3, 1)])
def test_cosmos3_step_flops_counts_every_matrix_product(prompt_len, frames, rows):
    c = _make_config(get("tiny-cosmos3"))
    model = random_transformer(c.transformer, prompt_len, "cpu", torch.float32)
    cfg, pp = model.config, model.config.latent_patch_size
    und = model.understand([torch.randint(0, cfg.vocab_size, (prompt_len,)).tolist()],
                           [rope.rope_table(rope.text_positions(prompt_len, cfg), cfg)])[0]
    grid = (frames, 2, 3)
    x = torch.randn(rows, cfg.latent_channel, frames, grid[1] * pp, grid[2] * pp)
    table = rope.rope_table(rope.vision_positions(grid, rope.vision_offset(prompt_len, cfg), 24.0, 4, cfg), cfg)
    with FlopCounterMode(display=False) as fc:
        model.generate(x, torch.full((rows,), 500), list(range(rows)), [und] * rows, table.repeat(rows, 1))
    S = grid[0] * grid[1] * grid[2]
    assert fc.get_total_flops() == rows * B.cosmos3_step_flops(cfg, S, prompt_len)


@pytest.mark.parametrize("argv", [["--model", "tiny-cosmos3", "--size", "64x64", "--frames", "1", "--text-len", "9"],
                                  ["--model", "tiny-wan", "--size", "32x32", "--frames", "5"]])
def test_profile_dit_prints_the_step_and_its_kernels(argv, capsys):
    assert profile_dit.main([*argv, "--rows", "2", "--repeats", "1", "--top", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "a forward" in out and "TFLOP/s" in out and "kernels" in out and "gemm" in out


def test_profile_dit_refuses_other_families():
    with pytest.raises(SystemExit):
        profile_dit.main(["--model", "tiny-qwen3.5", "--device", "cpu"])


def test_profile_vae_records_every_combination(tmp_path, capsys):
    out = tmp_path / "vae.jsonl"
    assert profile_vae.main(["--tiny", "--size", "64x32", "--frames", "9", "--dtypes", "float32", "bfloat16",
                             "--channels-last", "0", "1", "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * 2 and capsys.readouterr().out.count("a decode") == 4
    for r in recs:
        assert r["bench"] == "vae_decode" and r["commit"] and r["decode_s"] > 0 and r["conv_tflop"] >= 0
        if r["dtype"] == "float32":  # options that keep the function: rounding apart
            assert r["max_abs_vs_first"] < 1e-5
        else:
            assert 0 < r["rel_vs_first"] < 3e-2
    first = recs[0]
    assert (first["dtype"], first["channels_last"]) == ("float32", False)


def test_conv_flops_are_counted_per_output_element():
    w = torch.randn(4, 3, 3, 3, 3)
    flops = profile_vae.count_conv_flops(lambda: torch.nn.functional.conv3d(torch.randn(1, 3, 5, 6, 7), w))
    assert flops == 2 * (3 * 27) * (4 * 3 * 4 * 5)


def test_profile_dit_profiles_the_understanding_tower(capsys):
    assert profile_dit.main(["--model", "tiny-cosmos3", "--understand", "--text-len", "12", "--repeats", "1",
                             "--top", "2", "--device", "cpu"]) == 0
    assert "understanding tower, prompts of 12 and 6 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile_dit.main(["--model", "tiny-wan", "--understand", "--device", "cpu"])
