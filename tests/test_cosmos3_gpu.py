"""Cosmos3 on CUDA: the generation tower's step replayed from CUDA graphs (MSTAR_DIT_GRAPHS,
models/shape_graphs.py) is bit-identical to the eager step, for two batch shapes (a graph each,
rows with prompts of different lengths) and fresh inputs into a captured shape."""

from __future__ import annotations

import pytest
import torch

from mstar.models.cosmos3 import rope
from mstar.models.cosmos3.config import TINY_COSMOS3_TRANSFORMER
from mstar.models.cosmos3.family import random_transformer
from mstar.models.shape_graphs import ShapeGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(model, prompts: list[int], seed: int):
    """Latents of 2 requests (1 latent frame of 4 x 4), their timesteps, rows = one per prompt,
    each row's prompt K/V from the understanding tower and its vision rotary table."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn((2, cfg.latent_channel, 1, 4, 4), generator=g).cuda()
    t = torch.randint(0, 1000, (2,), generator=g).cuda()
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in prompts]
    und = model.understand(ids, [rope.rope_table(rope.text_positions(n, cfg), cfg) for n in prompts])
    rows = [r % 2 for r in range(len(prompts))]
    s = 4 // cfg.latent_patch_size
    table = torch.cat([rope.rope_table(rope.vision_positions((1, s, s), rope.vision_offset(n, cfg), 24.0, 4, cfg),
                                       cfg) for n in prompts]).cuda()
    return latents, t, torch.tensor(rows).cuda(), table, [x for u in und for x in (u.k, u.v)]


def test_graph_replay_equals_eager():
    model = random_transformer(TINY_COSMOS3_TRANSFORMER, int(torch.randint(1 << 30, ()).item()), "cuda",
                               torch.bfloat16)
    graphed = ShapeGraphs(model.generate_rows, max_graphs=2)
    for seed, prompts in ((0, [5, 9]), (1, [5, 9]), (2, [7]), (3, [5, 9]), (4, [7])):
        latents, t, rows, table, kv = _inputs(model, prompts, seed)
        eager = model.generate_rows(latents, t, rows, table, *kv)
        for _ in range(3):
            torch.testing.assert_close(graphed(latents, t, rows, table, *kv), eager, rtol=0, atol=0)
    assert graphed.captures == 2
