"""MSTAR_DIT_COMPILE: the denoising step through torch.compile (Inductor, here on CPU) against the
eager step, on fresh random inputs: Cosmos3's generation tower (rows with prompts of different
lengths, two batch shapes) and Wan's transformer. The compiled step reorders float32 sums, so
the bound is relative: 1e-4 of the output's scale. With the knob off (the default) the step is
the plain function."""

from __future__ import annotations

import pytest
import torch

from mstar import knobs
from mstar.models.cosmos3 import rope
from mstar.models.cosmos3.config import TINY_COSMOS3_TRANSFORMER
from mstar.models.cosmos3.family import random_transformer
from mstar.models.cosmos3.transformer import JointKV
from mstar.models.shape_graphs import denoiser_step

TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _cosmos3_inputs(model, prompts: list[int], seed: int):
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn((2, cfg.latent_channel, 1, 4, 4), generator=g)
    t = torch.randint(0, 1000, (2,), generator=g)
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in prompts]
    und = model.understand(ids, [rope.rope_table(rope.text_positions(n, cfg), cfg) for n in prompts])
    s = 4 // cfg.latent_patch_size
    table = torch.cat([rope.rope_table(rope.vision_positions((1, s, s), rope.vision_offset(n, cfg), 24.0, 4, cfg),
                                       cfg) for n in prompts])
    rows = torch.tensor([r % 2 for r in range(len(prompts))])
    j = JointKV.of(und, s * s)
    return latents, t, rows, table, (j.kv_rows, j.k, j.v, j.prompt_lens)


def test_default_is_the_plain_step():
    model = random_transformer(TINY_COSMOS3_TRANSFORMER, 0, "cpu", torch.float32)
    step = denoiser_step(model.generate_rows)
    assert step.fn == model.generate_rows


@pytest.mark.slow
def test_compiled_cosmos3_step_matches_eager():
    model = random_transformer(TINY_COSMOS3_TRANSFORMER, int(torch.randint(1 << 30, ()).item()), "cpu",
                               torch.float32)
    with knobs.override(MSTAR_DIT_COMPILE=True):
        step = denoiser_step(model.generate_rows)
    assert step.fn != model.generate_rows
    for seed, prompts in ((int(torch.randint(1 << 30, ()).item()), [5, 9]), (1, [7])):
        args = _cosmos3_inputs(model, prompts, seed)
        want = model.generate_rows(*args[:4], *args[4])
        with torch.inference_mode():  # as the engine runs its stages
            got = step(*args[:4], *args[4])
        assert _rel(got, want) < TOL, _rel(got, want)


@pytest.mark.slow
def test_compiled_wan_step_matches_eager():
    from mstar.models.wan.family import random_transformer as random_wan
    from mstar.models.wan.transformer_config import TINY_WAN_TRANSFORMER as C
    model = random_wan(C, int(torch.randint(1 << 30, ()).item()), "cpu", torch.float32)
    with knobs.override(MSTAR_DIT_COMPILE=True):
        step = denoiser_step(model.forward_kv, constant_from=2)  # as the pipeline builds it
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ()).item()))
    for B, F, H, W in ((2, 3, 4, 6), (1, 1, 4, 4)):
        latents = torch.randn(B, C["in_channels"], F, H, W, generator=g)
        text = torch.randn(B, 7, C["text_dim"], generator=g)
        t = torch.rand(B, generator=g) * 1000.0
        want = model(latents, t, text)
        with torch.inference_mode():
            got = step(latents, t, *model.text_kv(text))
        assert _rel(got, want) < TOL, _rel(got, want)
