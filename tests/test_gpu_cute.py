"""CuTe DSL backends on CUDA (run on the GPU host, with kernel_cache/ built by
`python -m mstar.ops.cache build --preset qwen3.5-0.8b --preset qwen3.5-4b --preset qwen3-0.6b --bench`):
each kernel against the reference on random inputs, on a side stream, and captured in a CUDA
graph and replayed on new inputs. A kernel missing from the cache where the DSL cannot build it
fails here (it would silently fall back to another backend in serving)."""

import pytest
import torch

from mstar.ops import registry
from mstar.ops.cache import cute as aot

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _kernel_or_fail(k, params):
    fn = k.get(params, aot.arch_of_device())
    assert fn is not None, (f"CuTe kernel {k.name} {params} is neither in {k.kernel_dir()} nor buildable here: "
                            f"run `python -m mstar.ops.cache build --bench ...` where nvidia-cutlass-dsl is installed "
                            f"({[e.get('error') for e in aot.EVENTS if e['kernel'] == k.name]})")
    return fn


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _check_graph(fn, make_args, ref_fn, tol, mutated=()):
    """Capture fn(*static) in a CUDA graph, refill the inputs, replay, compare with the reference."""
    static = make_args()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream, as capture wants
        fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in static])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)
    for _ in range(2):
        fresh = make_args()
        for a, f in zip(static, fresh):
            if isinstance(a, torch.Tensor):
                a.copy_(f)
        ref_in = [a.clone() if isinstance(a, torch.Tensor) else a for a in static]
        g.replay()
        torch.cuda.synchronize()
        ref = ref_fn(*ref_in)
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        for o, r in zip(outs, refs):
            _close(o, r, tol)
        for i in mutated:
            _close(static[i], ref_in[i], 1e-3)


NORM_CASES = [(1024, True), (2560, True), (256, True), (1024, False), (128, False)]


@pytest.mark.parametrize("rows", [1, 32, 128, 300])
@pytest.mark.parametrize("hidden,zc", NORM_CASES)
def test_rms_norm_and_fused_add(rows, hidden, zc):
    from mstar.ops.backends import cute_norm as cn

    _kernel_or_fail(cn.K_RMS, cn.norm_params("rms", hidden, "bfloat16", "bfloat16", zc))
    rms = registry.get("rms_norm")
    x = torch.randn(rows, hidden, dtype=BF16, device="cuda") * 3
    w = torch.randn(hidden, dtype=BF16, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):  # follows the current stream
        got = rms.backends["cute"].fn(x, w, 1e-6, zc)
    torch.cuda.synchronize()
    _close(got, rms.backends["reference"].fn(x, w, 1e-6, zc), 2e-2)
    if hidden >= 1024:
        _kernel_or_fail(cn.K_ADD, cn.norm_params("add_rms", hidden, "bfloat16", "bfloat16", zc))
        fa = registry.get("fused_add_rms_norm")
        r = torch.randn_like(x)
        y, s = fa.backends["cute"].fn(x, r, w, 1e-6, zc)
        y_ref, s_ref = fa.backends["reference"].fn(x, r, w, 1e-6, zc)
        assert torch.equal(s, s_ref), "the new residual is x + residual rounded to bf16, exactly"
        _close(y, y_ref, 2e-2)


@pytest.mark.parametrize("hidden,zc", [(1024, True), (256, True), (128, False)])
def test_rms_norm_3d_input(hidden, zc):  # q/k norms see [tokens, heads, head_dim]
    from mstar.ops.backends import cute_norm as cn

    _kernel_or_fail(cn.K_RMS, cn.norm_params("rms", hidden, "bfloat16", "bfloat16", zc))
    rms = registry.get("rms_norm")
    x = torch.randn(7, 8, hidden, dtype=BF16, device="cuda")
    w = torch.randn(hidden, dtype=BF16, device="cuda")
    _close(rms.backends["cute"].fn(x, w, 1e-6, zc), rms.backends["reference"].fn(x, w, 1e-6, zc), 2e-2)


@pytest.mark.parametrize("rows", [1, 16 * 32, 16 * 128 + 3])
def test_gated_rms_norm(rows):
    from mstar.ops.backends import cute_norm as cn

    _kernel_or_fail(cn.K_GATED, cn.norm_params("gated", 128, "bfloat16", "bfloat16"))
    op = registry.get("gated_rms_norm")
    x = torch.randn(rows, 128, dtype=BF16, device="cuda")
    z = torch.randn(rows, 128, dtype=BF16, device="cuda") * 4
    w = torch.randn(128, dtype=BF16, device="cuda")
    _close(op.backends["cute"].fn(x, z, w, 1e-6), op.backends["reference"].fn(x, z, w, 1e-6), 2e-2)


def _gdn_args(b, h, slots_total=None, dk=128, dv=128):
    n = slots_total or 2 * b + 3
    q = torch.nn.functional.normalize(torch.randn(b, h, dk, device="cuda"), dim=-1).to(BF16)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, device="cuda"), dim=-1).to(BF16)
    v = torch.randn(b, h, dv, dtype=BF16, device="cuda")
    g = -torch.rand(b, h, device="cuda") * 0.5
    beta = torch.rand(b, h, device="cuda").to(BF16)
    pool = torch.randn(n, h, dk, dv, device="cuda") * 0.1
    slots = torch.randperm(n, device="cuda")[:b].to(torch.int64)
    return [q, k, v, g, beta, pool, slots, dk ** -0.5]


@pytest.mark.parametrize("b", [1, 32, 128])
@pytest.mark.parametrize("h", [16, 32])
def test_gdn_decode_in_place(b, h):
    from mstar.ops.backends import cute_gdn as cg

    _kernel_or_fail(cg.K_DECODE, cg.decode_params(128, 128, "bfloat16", "bfloat16", "float32", "bfloat16"))
    op = registry.get("gdn_decode")
    args = _gdn_args(b, h)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    untouched = torch.ones(args[5].shape[0], dtype=torch.bool, device="cuda")
    untouched[args[6]] = False
    before = args[5][untouched].clone()
    with torch.cuda.stream(torch.cuda.Stream()):
        o = op.backends["cute"].fn(*args)
    torch.cuda.synchronize()
    o_ref = op.backends["reference"].fn(*ref_args)
    _close(o, o_ref, 2e-2)
    _close(args[5], ref_args[5], 1e-3)
    assert torch.equal(args[5][untouched], before), "slots not named must not change"


def test_graphs_capture_and_replay():
    from mstar.ops.backends import cute_gdn as cg
    from mstar.ops.backends import cute_norm as cn

    _kernel_or_fail(cn.K_ADD, cn.norm_params("add_rms", 1024, "bfloat16", "bfloat16", True))
    _kernel_or_fail(cn.K_GATED, cn.norm_params("gated", 128, "bfloat16", "bfloat16"))
    _kernel_or_fail(cg.K_DECODE, cg.decode_params(128, 128, "bfloat16", "bfloat16", "float32", "bfloat16"))
    fa, ga, gd = registry.get("fused_add_rms_norm"), registry.get("gated_rms_norm"), registry.get("gdn_decode")
    w = torch.randn(1024, dtype=BF16, device="cuda")
    _check_graph(fa.backends["cute"].fn,
                 lambda: (torch.randn(32, 1024, dtype=BF16, device="cuda"),
                          torch.randn(32, 1024, dtype=BF16, device="cuda"), w, 1e-6, True),
                 fa.backends["reference"].fn, 2e-2)
    wg = torch.randn(128, dtype=BF16, device="cuda")
    _check_graph(ga.backends["cute"].fn,
                 lambda: (torch.randn(512, 128, dtype=BF16, device="cuda"),
                          torch.randn(512, 128, dtype=BF16, device="cuda"), wg, 1e-6),
                 ga.backends["reference"].fn, 2e-2)
    base = _gdn_args(32, 16)

    def make():
        fresh = _gdn_args(32, 16, slots_total=base[5].shape[0])
        fresh[6] = base[6]  # same slots each replay (captured addresses; contents may change)
        return fresh

    _check_graph(gd.backends["cute"].fn, make, gd.backends["reference"].fn, 2e-2, mutated=(5,))


def test_backend_listed_and_selectable():
    from mstar import knobs

    for op in ("rms_norm", "fused_add_rms_norm", "gated_rms_norm", "gdn_decode"):
        b = registry.get(op).backends["cute"]
        assert b.is_available(), f"cute backend of {op} not available on this GPU host"
    with knobs.override(MSTAR_BACKENDS="rms_norm=cute,gdn_decode=cute"):
        assert registry.get("rms_norm").selected("cuda") == "cute"
        assert registry.get("gdn_decode").selected("cuda") == "cute"
