"""Cosmos3 on CUDA: the generation tower's step replayed from CUDA graphs (MSTAR_DIT_GRAPHS,
models/shape_graphs.py) is bit-identical to the eager step, for three batch shapes (a graph each,
rows with prompts of different lengths) and fresh inputs into a captured shape, with and without
constant inputs; the fused head kernel writing into the joint keys equals the unfused step."""

from __future__ import annotations

import pytest
import torch

from mstar.models.cosmos3 import rope
from mstar.models.cosmos3.config import TINY_COSMOS3_TRANSFORMER
from mstar.models.cosmos3.family import random_transformer
from mstar.models.cosmos3.transformer import JointKV
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
    j = JointKV.of(und, s * s)
    return latents, t, torch.tensor(rows).cuda(), table, (j.kv_rows, j.k, j.v, j.prompt_lens)


@pytest.mark.parametrize("constant_from", [None, 2])
def test_graph_replay_equals_eager(constant_from):
    model = random_transformer(TINY_COSMOS3_TRANSFORMER, int(torch.randint(1 << 30, ()).item()), "cuda",
                               torch.bfloat16)
    graphed = ShapeGraphs(model.generate_rows, max_graphs=3, constant_from=constant_from)
    # (5, 9) twice with fresh inputs: the same graph, its constant inputs copied again; (9, 5): the
    # same shapes of every tensor, other prompt lengths: a graph of its own
    for seed, prompts in ((0, [5, 9]), (1, [5, 9]), (2, [7]), (3, [9, 5]), (4, [5, 9]), (5, [7])):
        latents, t, rows, table, joint = _inputs(model, prompts, seed)
        eager = model.generate_rows(latents, t, rows, table, *joint)
        for _ in range(3):
            torch.testing.assert_close(graphed(latents, t, rows, table, *joint), eager, rtol=0, atol=0)
    assert graphed.captures == 3


def test_joint_kv_step_equals_the_concatenated_keys():
    """The step through the fused head kernel and the joint keys equals the step through the three
    projections (unfused: rotary_embedding, index_copy) on the same weights."""
    model = random_transformer(TINY_COSMOS3_TRANSFORMER, 11, "cuda", torch.float32)
    latents, t, rows, table, joint = _inputs(model, [5, 9], 0)
    fused = model.generate_rows(latents, t, rows, table, *joint)
    plain = random_transformer(TINY_COSMOS3_TRANSFORMER, 11, "cuda", torch.float32)
    for layer in plain.layers:
        layer.self_attn._gen_qkv = None
    torch.testing.assert_close(plain.generate_rows(latents, t, rows, table, *joint), fused, rtol=1e-4, atol=1e-4)
