"""The fused-linear ops: the Triton kernel (Triton's CPU interpreter) against a float64 computation of
the op followed by the product, for each prologue, 1-8 rows, two block shapes, K and N that leave
partial blocks, gates read through a head stride from inside a wider projection; a tiny Qwen3.5
decoding one row a step with every one of its fused-linear ops through the kernel, against
transformers; and the ops' CPU path, which is the elementwise op then F.linear, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from mstar import ops
from mstar.ops.activation import _sigmoid_mul_ref, _silu_and_mul_ref
from mstar.ops.norm import _fused_add_rms_norm_ref, _gated_rms_norm_ref

_SCRIPT = r"""
import json, torch
from mstar.ops.backends import triton_fused_linear as fl
from test_fused_linear import case, want
seed = int(torch.randint(1 << 30, ()))
out = []
configs = [dict(BN=8, BK=64, num_warps=4, num_stages=1), dict(BN=16, BK=128, num_warps=4, num_stages=1)]
for i, pro in enumerate((fl.ADD_RMS, fl.SILU_MUL, fl.GATED_RMS, fl.SIGMOID_MUL)):
    for m in (1, 3, 8):
        for ci, cfg in enumerate(configs):
            args = case(seed + 10 * i + m, pro, m, torch.float32)
            y, res = fl.launch(*args["launch"], config=cfg)
            ref, ref_res = want(pro, args)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            res_err = 0.0 if res is None else (res.double() - ref_res).abs().max().item()
            out.append([int(pro), m, ci, err, res_err])
print(json.dumps(out))
"""

_K, _N, _HEADS, _D = 200, 70, 3, 32  # partial K and N blocks; 3 heads of 32 for the per-head prologues


def case(seed: int, pro: int, m: int, dtype) -> dict:
    """Random inputs of one prologue, laid out as a decoder step has them, and launch's arguments."""
    from mstar.ops.backends import triton_fused_linear as fl
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    nw = rand(_K, scale=0.3)
    if pro in (fl.GATED_RMS, fl.SIGMOID_MUL):
        k = _HEADS * _D
        x = rand(m, _HEADS, _D)
        wide = rand(m, 2 * k + 7)  # the gate lives inside a wider projection, every other head slot
        aux = wide[:, 7:].view(m, _HEADS, 2 * _D)[..., _D:]
        nw = rand(_D, scale=0.3) + 1
        w = rand(_N, k, scale=k ** -0.5)
        launch = (pro, x.view(m, k), aux, aux.stride(0), aux.stride(1), nw, w, 1e-6, False, _D)
        return dict(x=x, aux=aux, nw=nw, w=w, launch=launch)
    w = rand(_N, _K, scale=_K ** -0.5)
    if pro == fl.SILU_MUL:
        x = rand(m, 2 * _K)
        return dict(x=x, w=w, launch=(pro, x[:, :_K], x[:, _K:], x.stride(0), 0, None, w))
    x = rand(m, _K, scale=3.0)
    r = rand(m, _K, scale=3.0)
    zc = bool(seed % 2)
    return dict(x=x, aux=r, nw=nw, w=w, zc=zc, launch=(pro, x, r, r.stride(0), 0, nw, w, 1e-6, zc))


def want(pro: int, a: dict):
    """float64: (the op's output @ w.T, the new residual or None)."""
    from mstar.ops.backends import triton_fused_linear as fl
    x, w = a["x"].double(), a["w"].double()
    res = None
    if pro == fl.ADD_RMS:
        res = x + a["aux"].double()
        nw = a["nw"].double() + (1.0 if a["zc"] else 0.0)
        x = res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    elif pro == fl.SILU_MUL:
        x = F.silu(x[:, :_K]) * x[:, _K:]
    elif pro == fl.GATED_RMS:
        z = a["aux"].double()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * a["nw"].double() * F.silu(z)).flatten(1)
    elif pro == fl.SIGMOID_MUL:
        x = (x * torch.sigmoid(a["aux"].double())).flatten(1)
    return x @ w.T, res


def test_fused_linear_kernel_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 4 * 3 * 2
    for pro, m, cfg, err, res_err in got:
        assert err < 1e-5 and res_err < 1e-5, (pro, m, cfg, err, res_err)


_MODEL_SCRIPT = r"""
import json, os, tempfile, torch
os.environ["MSTAR_FUSED_LINEAR_SHAPES"] = "any"  # the tiny model's products are not in the tuned table
from mstar.ops import registry
from mstar.ops.backends import triton_fused_linear as fl
from mstar.models import load_model
from hf_models import make_hf_model, qwen3_5_config, check_prefill_then_decode
calls = {}
launch = fl.launch
def counted(pro, *args, **kw):
    calls[int(pro)] = calls.get(int(pro), 0) + 1
    return launch(pro, *args, **kw)
fl.launch = counted
for name in ("add_rms_norm_linear", "silu_mul_linear", "gated_rms_norm_linear", "sigmoid_mul_linear"):
    registry.register_backend(name, "interpreted", getattr(fl, name), devices=("cpu",), priority=100)
hf = make_hf_model(qwen3_5_config(False, key_dim=32, value_dim=64), seed=int(torch.randint(1 << 20, ())))
with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    model = load_model(d, progress=False)
check_prefill_then_decode(hf, model, lengths=[11], decode_steps=3, vocab=512)  # raises past its tolerance
print(json.dumps(calls))
"""


def test_tiny_qwen3_5_decodes_through_the_kernel():
    """One sequence (one row a decode step), MSTAR_FUSED_LINEAR_SHAPES=any: every decode step's norms,
    gates and activations go through the kernel (its CPU registration here stands in for CUDA), and
    the logits stay within the model tests' 1e-4 of transformers'."""
    calls = run_interpreted(_MODEL_SCRIPT)
    # 3 decode steps x 6 layers: input norm (layer 0's has no residual yet), post norm, down,
    # the gated norm (4 GDN layers), the sigmoid gate (2 attention layers)
    assert calls == {"1": 3 * 11, "2": 3 * 6, "3": 3 * 4, "4": 3 * 2}, calls


def test_cpu_path_is_the_composed_ops_bit_for_bit():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    t, h, heads, d, n = 5, 64, 4, 16, 48
    x, r = torch.randn(t, h, generator=g).bfloat16(), torch.randn(t, h, generator=g).bfloat16()
    nw, w = torch.randn(h, generator=g).bfloat16(), torch.randn(n, h, generator=g).bfloat16()
    y, s = ops.add_rms_norm_linear(x, r, nw, 1e-6, True, w)
    normed, s_ref = _fused_add_rms_norm_ref(x, r, nw, 1e-6, True)
    assert torch.equal(y, F.linear(normed, w)) and torch.equal(s, s_ref)

    gu = torch.randn(t, 2 * h, generator=g).bfloat16()
    assert torch.equal(ops.silu_mul_linear(gu, w), F.linear(_silu_and_mul_ref(gu), w))

    o = torch.randn(t, heads, d, generator=g).bfloat16()
    z = torch.randn(t, heads, 2 * d, generator=g).bfloat16()[..., d:]
    w2, nw2 = torch.randn(n, heads * d, generator=g).bfloat16(), torch.randn(d, generator=g).bfloat16()
    assert torch.equal(ops.gated_rms_norm_linear(o, z, nw2, 1e-6, w2),
                       F.linear(_gated_rms_norm_ref(o, z, nw2, 1e-6).reshape(t, -1), w2))
    assert torch.equal(ops.sigmoid_mul_linear(o, z, w2), F.linear(_sigmoid_mul_ref(o, z).reshape(t, -1), w2))


@pytest.mark.parametrize("preset", ["qwen3.5-0.8b", "qwen3.5-4b"])
def test_every_one_row_product_of_the_presets_is_tuned(preset):
    """The tuned table holds each product a Qwen3.5 0.8B / 4B decode layer hands a fused-linear op
    (built on the meta device from the preset), and the per-head ops' K blocks hold whole heads:
    a shape missing here would run composed without a word."""
    from mstar.models import presets
    from mstar.models.qwen3_5.model import GatedDeltaNet, Qwen3_5ForCausalLM
    from mstar.ops.backends import triton_fused_linear as fl
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(presets.make_config(presets.get(preset)))
    for layer in model.model.layers:
        m = layer.mixer
        gdn = isinstance(m, GatedDeltaNet)
        wanted = [(fl.ADD_RMS, m.input_projection().weight, 1), (fl.ADD_RMS, layer.mlp.gate_up_proj.weight, 1),
                  (fl.SILU_MUL, layer.mlp.down_proj.weight, 1),
                  (fl.GATED_RMS, m.out_proj.weight, m.head_v_dim) if gdn else (fl.SIGMOID_MUL, m.o_proj.weight, m.head_dim)]
        for pro, w, head in wanted:
            cfg = fl.pick_config(pro, *w.shape)
            assert cfg is not None, (preset, int(pro), tuple(w.shape))
            assert cfg["BK"] % head == 0, (preset, int(pro), cfg)


def test_untuned_shapes_run_composed_unless_the_knob_says_any():
    from mstar import knobs
    from mstar.ops.backends import triton_fused_linear as fl
    assert knobs.value("MSTAR_FUSED_LINEAR_SHAPES") == "tuned"
    assert fl.pick_config(fl.ADD_RMS, 640, 128) is None
    tuned = fl.pick_config(fl.ADD_RMS, 8224, 1024)
    with knobs.override(MSTAR_FUSED_LINEAR_SHAPES="any"):
        bn, bk, warps = fl.UNTUNED
        assert fl.pick_config(fl.ADD_RMS, 640, 128) == dict(BN=bn, BK=bk, num_warps=warps, num_stages=3)
        assert fl.pick_config(fl.ADD_RMS, 8224, 1024) == tuned  # the tuned shapes' blocks either way
