"""ops.add_rms_norm_swiglu (a decoder layer's norm + SwiGLU MLP): the persistent kernel (Triton's CPU
interpreter runs its two steps as two launches) against float64, over several grid sizes and blocks
that leave partial tiles; a tiny Qwen3.5 decoding one row a step with every MLP through the kernel,
against transformers; the CPU path, which is the two fused-linear ops, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from mstar import ops

_K, _I, _N = 200, 150, 70  # hidden, intermediate, output: partial blocks everywhere

_SCRIPT = r"""
import json, torch
from mstar.ops.backends import triton_swiglu_mlp as m
from test_swiglu_mlp import case, want
seed = int(torch.randint(1 << 30, ()))
out = []
# (per SM, BJ, BK1, BN, BK2, warps, prefetch): launch's grid is n_programs
configs = [(1, 4, 64, 4, 64, 4, 0), (1, 8, 128, 2, 32, 4, 0), (1, 2, 256, 8, 256, 4, 0)]
for ci, cfg in enumerate(configs):
    for n_programs in (1, 3, 7):
        a = case(seed + 10 * ci + n_programs)
        y, res = m.launch(*a["args"], config=cfg, n_programs=n_programs)
        ref, ref_res = want(a)
        out.append([ci, n_programs, ((y.double() - ref).abs().max() / ref.abs().max()).item(),
                    (res.double() - ref_res).abs().max().item()])
print(json.dumps(out))
"""


def case(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(1, _K, generator=g) * 3, torch.randn(1, _K, generator=g) * 3
    nw = torch.randn(_K, generator=g) * 0.3
    wgu = torch.randn(2 * _I, _K, generator=g) * _K ** -0.5
    wd = torch.randn(_N, _I, generator=g) * _I ** -0.5
    zc = bool(seed % 2)
    return dict(x=x, r=r, nw=nw, wgu=wgu, wd=wd, zc=zc, args=(x, r, nw, 1e-6, zc, wgu, wd))


def want(a: dict):
    """float64: (the MLP's output, x + residual)."""
    s = a["x"].double() + a["r"].double()
    nw = a["nw"].double() + (1.0 if a["zc"] else 0.0)
    gu = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * nw) @ a["wgu"].double().T
    return (F.silu(gu[:, :_I]) * gu[:, _I:]) @ a["wd"].double().T, s


def test_persistent_mlp_kernel_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 9
    for ci, n_programs, err, res_err in got:
        assert err < 1e-5 and res_err < 1e-5, (ci, n_programs, err, res_err)


_MODEL_SCRIPT = r"""
import json, tempfile, torch
from mstar.ops import registry
from mstar.ops.backends import triton_swiglu_mlp as m
from mstar.models import load_model
from hf_models import make_hf_model, qwen3_5_config, check_prefill_then_decode
cfg = qwen3_5_config(False, key_dim=32, value_dim=64)
m.TUNED[(cfg.hidden_size, cfg.intermediate_size)] = (1, 4, 64, 4, 64, 4, 0)  # the tiny model's shape
calls = []
launch = m.launch
def counted(*args, **kw):
    calls.append(1)
    return launch(*args, **kw)
m.launch = counted
registry.register_backend("add_rms_norm_swiglu", "interpreted", m.add_rms_norm_swiglu, devices=("cpu",), priority=100)
hf = make_hf_model(cfg, seed=int(torch.randint(1 << 20, ())))
with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    model = load_model(d, progress=False)
check_prefill_then_decode(hf, model, lengths=[11], decode_steps=3, vocab=512)  # raises past its tolerance
print(json.dumps(len(calls)))
"""


def test_tiny_qwen3_5_decodes_through_the_kernel():
    """One sequence (one row a decode step): every layer's MLP of every decode step goes through the
    kernel (its CPU registration here stands in for CUDA); the logits stay within the model tests'
    1e-4 of transformers'."""
    assert run_interpreted(_MODEL_SCRIPT) == 3 * 6  # 3 decode steps x 6 layers; the prefill's rows compose


def test_cpu_path_is_the_two_fused_linear_ops_bit_for_bit():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    t, h, i = 3, 64, 96
    x, r = torch.randn(t, h, generator=g).bfloat16(), torch.randn(t, h, generator=g).bfloat16()
    nw = torch.randn(h, generator=g).bfloat16()
    wgu, wd = torch.randn(2 * i, h, generator=g).bfloat16(), torch.randn(h, i, generator=g).bfloat16()
    y, s = ops.add_rms_norm_swiglu(x, r, nw, 1e-6, True, wgu, wd)
    gu, s_ref = ops.add_rms_norm_linear(x, r, nw, 1e-6, True, wgu)
    assert torch.equal(y, ops.silu_mul_linear(gu, wd)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("preset", ["qwen3.5-0.8b", "qwen3.5-4b"])
def test_the_presets_mlp_shapes_are_tuned(preset):
    from mstar.models import presets
    from mstar.models.qwen3_5.model import Qwen3_5ForCausalLM
    from mstar.ops.backends import triton_swiglu_mlp as m
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(presets.make_config(presets.get(preset)))
    mlp = model.model.layers[0].mlp
    assert m.pick_config(mlp.gate_up_proj.weight.shape[1], mlp.down_proj.weight.shape[1]) is not None
