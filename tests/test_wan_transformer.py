"""Wan2.2 TI2V diffusion transformer (mstar/models/wan/transformer*.py) against diffusers'
WanTransformer3DModel.

The reference is diffusers' model built from TINY_WAN_TRANSFORMER under a fixed seed, every
parameter then moved away from its initialisation (norm weights and biases off 1 / 0, the
scale_shift_tables and every bias redrawn, the weights perturbed), saved with save_pretrained
(config.json + diffusion_pytorch_model.safetensors, the diffusers transformer/ layout; once more
sharded) and read back through mstar's loader. A wrong name mapping, a swapped q / k / v, a wrong
rotary or modulation order moves the output by a sizeable fraction of its scale.

Tolerance (float32): TOL = 1e-5 of the reference output's largest magnitude. The two compute the
same float32 arithmetic in other orders (the patch Conv3d as one GEMM, attention as float32 bmm +
softmax instead of SDPA, mstar's RMSNorm / LayerNorm ops instead of torch's fused kernels, the
timestep MLP run once per distinct timestep): seen <= 3e-7 relative over the shapes below, so
1e-5 leaves a 30x margin, while a swapped q / k, a swapped norm_q / norm_k in one block, an
interleaved-vs-halves or sign-flipped rotary, or swapped shift / scale was seen 2e-2 .. 8e-1 off.
A batch against its rows alone: the same code on other GEMM shapes, within BATCH_TOL = 5e-6
relative (seen <= 3e-7; rows leaking into each other would be O(1)).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from mstar.models.wan import diffusers_files as df  # noqa: E402
from mstar.models.wan import transformer_weights as tw  # noqa: E402
from mstar.models.wan.transformer import WanTransformer  # noqa: E402
from mstar.models.wan.transformer_config import (TINY_WAN_TRANSFORMER, WAN22_TI2V_5B_TRANSFORMER,  # noqa: E402
                                                 WanTransformerConfig)

TOL = 1e-5
BATCH_TOL = 5e-6
TEXT_LEN = 7


def _reference(seed: int = 0):
    from diffusers import WanTransformer3DModel

    cfg = WanTransformerConfig.from_dict(TINY_WAN_TRANSFORMER)
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**cfg.to_dict()).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("scale_shift_table"):
                p.copy_(0.5 * noise)
            elif p.dim() == 1 and name.endswith(".weight"):  # norm weights
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.add_(0.3 * p.std() * noise)
    return cfg, ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg, ref = _reference()
    path = str(tmp_path_factory.mktemp("wan_transformer"))
    ref.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, df.WEIGHTS))
    return cfg, ref, tw.load_transformer(path, dtype=torch.float32), path


def _inputs(B: int, F: int, H: int, W: int, per_token: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    c = TINY_WAN_TRANSFORMER
    latents = torch.randn(B, c["in_channels"], F, H, W, generator=g)
    text = torch.randn(B, TEXT_LEN, c["text_dim"], generator=g)
    S = F * (H // 2) * (W // 2)
    rows = torch.tensor([937.0, 411.5, 60.0])[:B]  # a different timestep per row
    if per_token == "ti2v":  # Wan2.2 TI2V: the conditioning first frame at t = 0, the rest at the row's t
        t = rows[:, None].expand(B, S).clone()
        t[:, : S // F] = 0.0
    elif per_token:
        t = torch.rand(B, S, generator=g) * 1000.0
    else:
        t = rows
    return latents, t, text


def _ref_out(ref, latents, t, text):
    with torch.no_grad():
        return ref(latents, t, text, return_dict=False)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


CASES = [  # (B, F, H, W, per_token)
    (1, 3, 4, 6, False),
    (2, 3, 4, 6, False),
    (2, 3, 4, 6, "ti2v"),
    (2, 2, 6, 4, True),
    (1, 1, 8, 2, True),
]


@pytest.mark.parametrize("B,F,H,W,per_token", CASES)
def test_matches_diffusers(models, B, F, H, W, per_token):
    cfg, ref, model, _ = models
    latents, t, text = _inputs(B, F, H, W, per_token, seed=B * 100 + F * 10 + H)
    want = _ref_out(ref, latents, t, text)
    got = model(latents, t, text)
    assert got.shape == want.shape == (B, cfg.out_channels, F, H, W)
    assert got.dtype == torch.float32
    assert _rel(got, want) <= TOL, _rel(got, want)


def test_batch_equals_rows_alone(models):
    _, _, model, _ = models
    for per_token in (False, True):
        latents, t, text = _inputs(3, 2, 4, 6, per_token, seed=7)
        batch = model(latents, t, text)
        for i in range(3):
            alone = model(latents[i:i + 1], t[i:i + 1], text[i:i + 1])
            assert _rel(batch[i:i + 1], alone) <= BATCH_TOL, (per_token, i, _rel(batch[i:i + 1], alone))
        # rows really differ (per-row timestep and text reach the output)
        assert _rel(batch[0], batch[1]) > 1e-2


def test_sharded_checkpoint(models, tmp_path):
    _, ref, model, _ = models
    ref.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert os.path.isfile(os.path.join(tmp_path, df.INDEX))
    assert len(df.weight_files(str(tmp_path))) > 1
    sharded = tw.load_transformer(str(tmp_path), dtype=torch.float32)
    for (k, a), (k2, b) in zip(model.state_dict().items(), sharded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_checkpoint_is_checked(models, tmp_path):
    _, ref, _, _ = models
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    cfg = tw.read_config(models[3])
    lost = dict(sd)
    lost.pop("blocks.1.attn2.norm_k.weight")
    with pytest.raises(ValueError, match="lacks 1"):
        tw.load_state(tw.build_meta(cfg), {tw.mstar_name(k): v for k, v in lost.items()})
    odd = dict(sd, **{"blocks.0.attn1.to_qkv.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="no parameter takes"):
        tw.load_state(tw.build_meta(cfg), {tw.mstar_name(k): v for k, v in odd.items()})
    # a wrong shape (a config that does not fit the weights)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(dict(TINY_WAN_TRANSFORMER, ffn_dim=48), f)
    save_file(sd, os.path.join(tmp_path, df.WEIGHTS))
    with pytest.raises(ValueError, match="ffn.net.0.proj.weight"):
        tw.load_transformer(str(tmp_path))


def test_rotary_is_interleaved_complex():
    """The self-attention's rotary (ops.rms_norm_rotary): (x0 + i x1) e^(i a) per adjacent pair of
    each head, after the norm; rotated by a, then by -a, the normed vector comes back."""
    from mstar import ops
    x, w = torch.randn(1, 5, 16), torch.ones(16)
    ang = torch.rand(5, 4) * 6.0
    y = ops.rms_norm_rotary(x, w, ang.cos(), ang.sin(), 2, 1e-6)
    n = ops.rms_norm(x, w, 1e-6, False).view(1, 5, 2, 8)
    z = torch.view_as_complex(n.unflatten(-1, (-1, 2)).contiguous()) * torch.polar(torch.ones_like(ang), ang)[:, None]
    torch.testing.assert_close(y, torch.view_as_real(z).flatten(-2).view(1, 5, 16))
    back = ops.rms_norm_rotary(y, w, ang.cos(), -ang.sin(), 2, 1e-6)  # y is unit-RMS: the norm keeps it
    torch.testing.assert_close(back, n.view(1, 5, 16), rtol=1e-5, atol=1e-5)


def test_published_shape_on_meta():
    """WAN22_TI2V_5B_TRANSFORMER: the same parameter names (after the mapping) and shapes as
    diffusers' model of that config, 4,999,787,712 parameters (the 5B transformer)."""
    from diffusers import WanTransformer3DModel

    cfg = WanTransformerConfig.from_dict(WAN22_TI2V_5B_TRANSFORMER)
    assert (cfg.dim, cfg.num_layers, cfg.ffn_dim, cfg.patch_size, cfg.rope_dims) == (3072, 30, 14336, (1, 2, 2),
                                                                                     (44, 42, 42))
    with torch.device("meta"):
        ref = WanTransformer3DModel(**cfg.to_dict())
    model = tw.build_meta(cfg)
    want = {tw.mstar_name(k): tuple(v.shape) for k, v in ref.named_parameters()}
    got = {k: tuple(v.shape) for k, v in model.named_parameters()}
    assert got == want
    assert {tw.diffusers_name(k) for k in got} == set(ref.state_dict())
    n = sum(p.numel() for p in model.parameters())
    d, f = cfg.dim, cfg.ffn_dim
    block = 2 * (4 * (d * d + d) + 2 * d) + 2 * d + (d * f + f + f * d + d) + 6 * d
    top = (48 * 4 * d + d) + (256 * d + d + d * d + d) + (d * 6 * d + 6 * d) + (4096 * d + d + d * d + d) \
        + (d * 48 * 4 + 48 * 4) + 2 * d
    assert n == 30 * block + top == sum(p.numel() for p in ref.parameters()) == 4_999_787_712


def test_config_reading():
    cfg = WanTransformerConfig.from_dict(dict(WAN22_TI2V_5B_TRANSFORMER, _diffusers_version="0.35.0",
                                              window_size=[-1, -1]))
    assert cfg.extra == {"window_size": [-1, -1]}
    assert WanTransformerConfig.from_dict(dict(TINY_WAN_TRANSFORMER, out_channels=None)).out_channels == 8
    for bad in ({"added_kv_proj_dim": 5120}, {"image_dim": 1280}, {"qk_norm": "rms_norm"}):
        with pytest.raises(ValueError):
            WanTransformerConfig.from_dict(dict(TINY_WAN_TRANSFORMER, **bad))


def test_text_kv_once_then_steps_are_the_forward(models):
    """text_kv (the text embedder and every block's cross-attention keys / values, once a request)
    then forward_kv is the forward, bit for bit; fresh inputs each run."""
    cfg, _, model, _ = models
    seed = int(torch.randint(1 << 30, ()).item())
    latents, t, text = _inputs(2, 3, 4, 6, False, seed=seed)
    k, v = model.text_kv(text)
    assert k.shape == v.shape == (cfg.num_layers, 2, TEXT_LEN, cfg.dim)
    assert torch.equal(model.forward_kv(latents, t, k, v), model(latents, t, text))
    with pytest.raises(ValueError, match="text keys"):
        model.forward_kv(latents, t, k[:, :1], v[:, :1])


def test_bad_inputs(models):
    _, _, model, _ = models
    latents, t, text = _inputs(2, 3, 4, 6, False, seed=1)
    with pytest.raises(ValueError, match="multiples"):
        model(latents[..., :5], t, text)
    with pytest.raises(ValueError, match="timestep"):
        model(latents, t[:, None].expand(2, 5), text)
    with pytest.raises(ValueError, match="text_states"):
        model(latents, t, text[:1])


def test_bf16_keeps_float32_modules(models):
    cfg, _, model, path = models
    half = tw.load_transformer(path, dtype=torch.bfloat16)
    assert isinstance(half, WanTransformer)
    for name, p in half.named_parameters():
        keep = any(part in name.split(".") for part in ("time_embedder", "scale_shift_table", "norm2"))
        assert p.dtype == (torch.float32 if keep else torch.bfloat16), name
    latents, t, text = _inputs(1, 3, 4, 6, "ti2v", seed=3)
    out = half(latents, t, text)
    assert out.dtype == torch.bfloat16
    assert _rel(out.float(), model(latents, t, text)) < 0.1  # bf16 through 2 blocks: a sanity bound


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(models):
    """ShapeGraphs (the pipeline's MSTAR_DIT_GRAPHS) replays the same kernels: bit-identical
    outputs, for two batch shapes (a graph each) and fresh inputs into a captured shape."""
    from mstar.models.shape_graphs import ShapeGraphs
    model = tw.load_transformer(models[3], dtype=torch.bfloat16, device="cuda")
    graphed = ShapeGraphs(model.forward_kv, max_graphs=2, constant_from=2)  # as the pipeline builds it
    for seed, B in ((0, 2), (1, 2), (2, 1), (3, 2), (4, 1)):
        latents, t, text = (a.cuda() for a in _inputs(B, 3, 8, 8, False, seed))
        eager = model(latents, t, text)
        kv = model.text_kv(text)
        for _ in range(3):
            torch.testing.assert_close(graphed(latents, t, *kv), eager, rtol=0, atol=0)
    assert graphed.captures == 2
