"""Every fast backend against the reference on fresh random inputs, on the GPU.
Marked `gpu`: skipped on a CPU machine, run on the GPU host (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from mstar import knobs, ops
from mstar.ops import registry

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _fast_backends(op):
    e = registry.get(op)
    return [b.name for b in e.backends.values() if b.name != "reference" and DEV in b.devices and b.is_available()]


def _check(op, backend, args, tol, mutated=()):
    e = registry.get(op)
    a1 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    a2 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    got = e.backends[backend].fn(*a1)
    want = e.backends["reference"].fn(*a2)

    def close(x, y):
        if x is None:
            return
        if isinstance(x, (tuple, list)):
            for xx, yy in zip(x, y):
                close(xx, yy)
            return
        assert not torch.isnan(x.float()).any()
        err = (x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)
        assert err < tol, f"{op}/{backend}: relative error {err:.2e} > {tol}"

    close(got, want)
    for i in mutated:
        close(a1[i], a2[i])


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_elementwise(dtype):
    for n, h in [(1, 1024), (37, 2560), (300, 1000), (3, 1280)]:
        x, res, w = r(n, h, dtype=dtype), r(n, h, dtype=dtype), r(h, dtype=dtype)
        for b in _fast_backends("rms_norm"):
            _check("rms_norm", b, (x, w, 1e-6, True), _tol(dtype))
            _check("rms_norm", b, (x, w, 1e-6, False), _tol(dtype))
        for b in _fast_backends("fused_add_rms_norm"):
            _check("fused_add_rms_norm", b, (x, res, w, 1e-6, True), _tol(dtype))
        for b in _fast_backends("silu_and_mul"):
            _check("silu_and_mul", b, (r(n, 2 * h, dtype=dtype),), _tol(dtype))
        bias = r(h, dtype=dtype)
        for b in _fast_backends("layer_norm"):  # Whisper's (d 1280); a strided x too
            _check("layer_norm", b, (r(n, h + 8, dtype=dtype)[:, :h], w, bias, 1e-5), _tol(dtype))
        for b in _fast_backends("fused_add_layer_norm"):
            _check("fused_add_layer_norm", b, (x, res, w, bias, 1e-5), _tol(dtype))
    z = r(64 * 16, 128, dtype=dtype)
    for b in _fast_backends("gated_rms_norm"):
        _check("gated_rms_norm", b, (r(64 * 16, 128, dtype=dtype), z, r(128, dtype=dtype), 1e-6), _tol(dtype))
        # Qwen3.5's z: [T, H, D], a column slice of the input projection (read through its strides)
        zs = r(37, 3 * 16 * 128, dtype=dtype)[:, 16 * 128:2 * 16 * 128].reshape(37, 16, 128)
        _check("gated_rms_norm", b, (r(37, 16, 128, dtype=dtype), zs, r(128, dtype=dtype), 1e-6), _tol(dtype))
    for b in _fast_backends("l2_norm"):
        _check("l2_norm", b, (r(33, 16, 128, dtype=dtype), 1e-6), _tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_kv_append(dtype):
    cache = ops.build_cos_sin_cache(4096, 64, 1e7, device=DEV)
    t = 77
    pos = torch.randint(0, 4096, (t,), device=DEV)
    for b in _fast_backends("rotary_embedding"):
        _check("rotary_embedding", b, (pos, r(t, 8, 256, dtype=dtype), r(t, 2, 256, dtype=dtype), cache, 64),
               _tol(dtype))
    # q/k head norm + rotary from the fused projection: Qwen3.5 (gated, zero-centred, partial
    # rotary 64 of 256) and Qwen3 (plain weight, full rotary of 128)
    for hq, hk, d, rd, zc, gated in ((8, 2, 256, 64, True, True), (16, 8, 128, 128, False, False)):
        qkv = r(t, hq * d * (2 if gated else 1) + 2 * hk * d, dtype=dtype)
        cs = ops.build_cos_sin_cache(4096, rd, 1e7, device=DEV)
        for b in _fast_backends("qk_norm_rope"):
            _check("qk_norm_rope", b, (qkv, pos, r(d, dtype=dtype) * 0.1, r(d, dtype=dtype) * 0.1, cs, hq, hk, d, rd,
                                       1e-6, zc, gated), _tol(dtype))
        kc, vc = r(40, 16, hk, d, dtype=dtype), r(40, 16, hk, d, dtype=dtype)
        slots = torch.randperm(40 * 16, device=DEV)[:t]
        slots[3] = -1
        for b in _fast_backends("qk_norm_rope_append"):  # the caches compared whole
            _check("qk_norm_rope_append", b, (qkv, pos, r(d, dtype=dtype) * 0.1, r(d, dtype=dtype) * 0.1, cs, hq, hk,
                                              d, rd, 1e-6, zc, gated, kc, vc, slots), _tol(dtype), mutated=(12, 13))
        if gated:
            for b in _fast_backends("sigmoid_mul"):
                _check("sigmoid_mul", b, (r(t, hq, d, dtype=dtype), ops.split_qkv_heads(qkv, hq, hk, d, True)[3]),
                       _tol(dtype))
    kc, vc = r(40, 16, 2, 256, dtype=dtype), r(40, 16, 2, 256, dtype=dtype)
    slots = torch.randperm(40 * 16, device=DEV)[:t]
    slots[3] = -1
    for b in _fast_backends("kv_append"):
        _check("kv_append", b, (r(t, 2, 256, dtype=dtype), r(t, 2, 256, dtype=dtype), kc, vc, slots), 1e-6,
               mutated=(2, 3))


def _paged(lens, page, hkv, d, dtype):
    n_pages = sum((n + page - 1) // page for n in lens) + 3
    kc, vc = r(n_pages, page, hkv, d, dtype=dtype), r(n_pages, page, hkv, d, dtype=dtype)
    perm = torch.randperm(n_pages, device=DEV).to(torch.int32)
    indptr, used = [0], 0
    for n in lens:
        used += (n + page - 1) // page
        indptr.append(used)
    last = [n - (n - 1) // page * page for n in lens]
    return (kc, vc, torch.tensor(indptr, dtype=torch.int32, device=DEV), perm[:used].contiguous(),
            torch.tensor(last, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 256), (16, 4, 256), (32, 8, 128)])
def test_paged_attention(hq, hkv, d):
    dtype = torch.bfloat16
    lens = [1, 15, 16, 17, 300, 64]
    kc, vc, indptr, idx, last = _paged(lens, 16, hkv, d, dtype)
    for b in _fast_backends("paged_attention_decode"):
        _check("paged_attention_decode", b, (r(len(lens), hq, d, dtype=dtype), kc, vc, indptr, idx, last, d ** -0.5),
               2e-2)
    qo = [1, 5, 16, 17, 100, 64]
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    for b in _fast_backends("paged_attention_prefill"):
        _check("paged_attention_prefill", b,
               (r(sum(qo), hq, d, dtype=dtype), kc, vc, qo_indptr, indptr, idx, last, d ** -0.5), 2e-2)


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 256), (16, 4, 256), (32, 8, 128), (64, 4, 64)])
def test_small_batch_decode_attention_in_a_graph(hq, hkv, d):
    """The Triton decode kernels as the runtime's decode graphs run them: a plan per batch size,
    the graph captured over one page table and replayed over another (new lengths, new pages),
    against the reference and against an eager call on the host page table (equal); a batch past
    MAX_ROWS gets FlashInfer's plan and runs there."""
    with knobs.override(MSTAR_BACKENDS="paged_attention_decode=triton"):
        _small_batch_decode_in_a_graph(hq, hkv, d)


def _small_batch_decode_in_a_graph(hq, hkv, d):
    from mstar.ops import attention
    from mstar.ops.backends import triton_paged_decode as tpd
    bf, page, scale = torch.bfloat16, 16, d ** -0.5
    for batch in (1, 3, tpd.MAX_ROWS):
        plan = attention.decode_graph_plan(DEV, batch=batch, max_pages=batch * 64, num_q_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, page_size=page, dtype=bf, scale=scale)
        assert isinstance(plan, tpd.TritonDecodePlan)
        tables = [[1 + 37 * i for i in range(batch)], [700 - 90 * i for i in range(batch)]]
        kc, vc, _, _, _ = _paged([64 * page] * batch, page, hkv, d, bf)
        q = r(batch, hq, d, dtype=bf)

        def load(lens):
            _, _, indptr, idx, last = _paged(lens, page, hkv, d, bf)
            plan.plan(indptr.cpu(), idx, last.cpu())
            q.copy_(r(batch, hq, d, dtype=bf))
            return indptr.cpu(), idx, last.cpu()

        load(tables[0])
        ops.paged_attention_decode(q, kc, vc, plan.indptr, plan.indices, plan.last_page_len, scale)  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.paged_attention_decode(q, kc, vc, plan.indptr, plan.indices, plan.last_page_len, scale)
        for lens in tables + tables[::-1]:
            indptr, idx, last = load(lens)
            graph.replay()
            want = attention.paged_attention_decode.backends["reference"].fn(q, kc, vc, indptr, idx, last, scale)
            err = (out.float() - want.float()).norm() / want.float().norm()
            assert err < 1e-2, (batch, lens, err)
            # an eager step (host page table) runs the same kernels: the same output, bit for bit
            assert torch.equal(ops.paged_attention_decode(q, kc, vc, indptr, idx, last, scale), out), (batch, lens)
    big = attention.decode_graph_plan(DEV, batch=tpd.MAX_ROWS + 1, max_pages=64, num_q_heads=hq, num_kv_heads=hkv,
                                      head_dim=d, page_size=page, dtype=bf, scale=scale)
    assert not isinstance(big, tpd.TritonDecodePlan)


def _gdn_inputs(t, h, dk, dv, dtype):
    q = torch.nn.functional.normalize(r(t, h, dk), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(t, h, dk), dim=-1).to(dtype)
    return q, k, r(t, h, dv, dtype=dtype), -torch.rand(t, h, device=DEV) * 0.5, torch.rand(t, h, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_and_conv(dtype):
    h, dk, dv = 16, 128, 128
    pool = r(10, h, dk, dv) * 0.1
    slots = torch.tensor([7, 2, 5], device=DEV)
    for b in _fast_backends("gdn_decode"):
        _check("gdn_decode", b, (*_gdn_inputs(3, h, dk, dv, dtype), pool, slots, dk ** -0.5), 2e-2, mutated=(5,))
    cu = torch.tensor([0, 1, 70, 330], dtype=torch.int32, device=DEV)
    none = torch.empty(0, dtype=torch.int64, device=DEV)
    snap_t = torch.tensor([0, 15, 31, 100, 329], device=DEV)
    snap_s = torch.tensor([0, 1, 3, 4, 6], device=DEV)
    for b in _fast_backends("gdn_prefill"):
        _check("gdn_prefill", b, (*_gdn_inputs(330, h, dk, dv, dtype), pool, cu, slots, none, none, dk ** -0.5),
               2e-2, mutated=(5,))
        _check("gdn_prefill", b, (*_gdn_inputs(330, h, dk, dv, dtype), pool, cu, slots, snap_t, snap_s, dk ** -0.5),
               2e-2, mutated=(5,))
    # the fused decode step from the conv output (0.8B / 4B shapes: 16 key heads, 16 or 32 value heads)
    for hk, hv in ((16, 16), (16, 32)):
        fpool = r(10, hv, dk, dv) * 0.1
        zba = r(3, 2 * hv + 8, dtype=dtype)
        fused_args = (r(3, 2 * hk * dk + hv * dv, dtype=dtype), zba[:, :hv], zba[:, hv:2 * hv],
                      torch.rand(hv, device=DEV).mul(15).add(0.01).log().to(dtype), r(hv, dtype=dtype), fpool, slots,
                      hk, dk ** -0.5, 1e-6)
        for b in _fast_backends("gdn_decode_fused"):
            _check("gdn_decode_fused", b, fused_args, 2e-2, mutated=(5,))
        # the fused prefill (fla: grouped q, k), ragged rows, without and with snapshots
        zba = r(330, 2 * hv + 8, dtype=dtype)
        head = (r(330, 2 * hk * dk + hv * dv, dtype=dtype), zba[:, :hv], zba[:, hv:2 * hv],
                torch.rand(hv, device=DEV).mul(15).add(0.01).log().to(dtype), r(hv, dtype=dtype), fpool, cu, slots)
        for b in _fast_backends("gdn_prefill_fused"):
            _check("gdn_prefill_fused", b, (*head, none, none, hk, dk ** -0.5, 1e-6), 2e-2, mutated=(5,))
            _check("gdn_prefill_fused", b, (*head, snap_t, snap_s, hk, dk ** -0.5, 1e-6), 2e-2, mutated=(5,))
    c, kk = 6144, 4
    cpool = r(10, c, kk - 1, dtype=dtype)
    for b in _fast_backends("causal_conv1d_update"):
        _check("causal_conv1d_update", b, (r(3, c, dtype=dtype), r(c, kk, dtype=dtype), None, cpool, slots, True),
               _tol(dtype), mutated=(3,))


@pytest.mark.parametrize("rows", [3, 128])
def test_gdn_decode_with_a_bfloat16_state(rows):
    """The state pool in bfloat16 (MSTAR_GDN_STATE_DTYPE's default for half-precision models): at 3
    rows the kernels take 32 value columns a program, at 128 rows x 32 heads 64 (triton_gdn._launch_config)."""
    hk, hv, dk, dv = 16, 32, 128, 128
    pool = (r(rows + 5, hv, dk, dv) * 0.1).to(torch.bfloat16)
    slots = torch.randperm(rows + 5, device=DEV)[:rows]
    for b in _fast_backends("gdn_decode"):
        _check("gdn_decode", b, (*_gdn_inputs(rows, hv, dk, dv, torch.bfloat16), pool, slots, dk ** -0.5), 2e-2,
               mutated=(5,))
    zba = r(rows, 2 * hv + 8, dtype=torch.bfloat16)
    fused_args = (r(rows, 2 * hk * dk + hv * dv, dtype=torch.bfloat16), zba[:, :hv], zba[:, hv:2 * hv],
                  torch.rand(hv, device=DEV).mul(15).add(0.01).log().to(torch.bfloat16),
                  r(hv, dtype=torch.bfloat16), pool, slots, hk, dk ** -0.5, 1e-6)
    for b in _fast_backends("gdn_decode_fused"):
        _check("gdn_decode_fused", b, fused_args, 2e-2, mutated=(5,))


def test_copy_rows_equals_torch():
    """The GDN state pool's gather (cast up) and scatter (cast down) kernel against torch, exactly."""
    from mstar.bench.tools import probe_state_rows as probe
    pool = torch.randn(40, 4, 128, 128, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(40, device="cuda")
    slots, snap_dst, snap_src = perm[:7], perm[7:10], torch.tensor([0, 3, 6], device="cuda")
    final = torch.randn(7, 4, 128, 128, device="cuda")
    p_torch, p_rows = pool.clone(), pool.clone()
    want_state = pool.index_select(0, slots).float()
    got_state = probe.copy_rows_moves(p_rows, slots, final, snap_src, snap_dst)
    probe.torch_moves(p_torch, slots, final, snap_src, snap_dst)
    assert torch.equal(got_state, want_state) and torch.equal(p_rows, p_torch)


@pytest.mark.parametrize("rows", [1, 3, 8, 9])  # 9: past the kernel's rows, composed
def test_fused_linear_ops(rows):
    """The fused-linear ops at the Qwen3.5 4B decode shapes (bf16) against the elementwise op then
    F.linear, with the gates read through head strides from inside their projections."""
    bf = torch.bfloat16
    x, res, nw = r(rows, 2560, dtype=bf), r(rows, 2560, dtype=bf), r(2560, dtype=bf) * 0.1
    w = r(12352, 2560, dtype=bf) * 2560 ** -0.5
    for b in _fast_backends("add_rms_norm_linear"):
        _check("add_rms_norm_linear", b, (x, res, nw, 1e-6, True, w), 1e-2)
        _check("add_rms_norm_linear", b, (x, res, nw, 1e-6, False, w), 1e-2)
    for b in _fast_backends("silu_mul_linear"):
        _check("silu_mul_linear", b, (r(rows, 2 * 9216, dtype=bf), r(2560, 9216, dtype=bf) * 0.01), 1e-2)
    o, wo = r(rows, 32, 128, dtype=bf), r(2560, 4096, dtype=bf) * 4096 ** -0.5
    z = r(rows, 3 * 4096, dtype=bf)[:, 4096:2 * 4096].reshape(rows, 32, 128)
    for b in _fast_backends("gated_rms_norm_linear"):
        _check("gated_rms_norm_linear", b, (o, z, r(128, dtype=bf), 1e-6, wo), 1e-2)
    qg = r(rows, 16, 512, dtype=bf)  # per head [query 256 | gate 256]
    for b in _fast_backends("sigmoid_mul_linear"):
        _check("sigmoid_mul_linear", b, (r(rows, 16, 256, dtype=bf), qg[..., 256:], wo), 1e-2)


def test_pdl_chain_in_a_graph_is_the_chain_without_it():
    """Eight 0.8B MLPs at one row, each product reading the one before (add + RMSNorm + gate_up,
    then SiLU-and-mul + down), and a conv update and a GDN decode step between them, captured in
    a CUDA graph with programmatic dependent launch: the replay's outputs equal, bit for bit, the
    chain launched eagerly without it. A kernel that read its input before its wait would see an
    earlier replay's (or garbage) values. Below sm_90, MSTAR_PDL=1 must launch plainly."""
    from mstar.ops.backends import pdl, triton_conv1d, triton_gdn
    from mstar.ops.backends import triton_fused_linear as fl
    # below sm_90 the knob launches every kernel plainly: the same comparison checks that fallback
    supported = pdl._supported(torch.cuda.current_device())
    bf, layers = torch.bfloat16, 8
    gate_up = [r(7168, 1024, dtype=bf) * 1024 ** -0.5 for _ in range(layers)]
    down = [r(1024, 3584, dtype=bf) * 3584 ** -0.5 for _ in range(layers)]
    nw = r(1024, dtype=bf) * 0.1
    conv_w, conv_pool = r(1024, 4, dtype=bf) * 0.5, r(4, 1024, 3, dtype=bf)
    gdn_pool, slot = r(4, 8, 128, 128, dtype=bf) * 0.1, torch.tensor([2], device=DEV, dtype=torch.int32)
    x0, res0 = r(1, 1024, dtype=bf), r(1, 1024, dtype=bf)

    def chain(x, res):
        for i in range(layers):
            h, res = fl.add_rms_norm_linear(x, res, nw, 1e-6, True, gate_up[i])
            x = fl.silu_mul_linear(h, down[i])
            x = triton_conv1d.causal_conv1d_update(x, conv_w, None, conv_pool, slot, True)
            q, k, v = x[:, :256].view(1, 2, 128), x[:, 256:512].view(1, 2, 128), x[:, :1024].view(1, 8, 128)
            g, beta = -torch.ones(1, 8, device=DEV) * 0.1, torch.full((1, 8), 0.5, device=DEV, dtype=bf)
            x = x + triton_gdn.gdn_decode(q.repeat_interleave(4, 1), k.repeat_interleave(4, 1), v, g, beta,
                                          gdn_pool, slot, 128 ** -0.5).reshape(1, 1024)
        return x, res

    pools = conv_pool.clone(), gdn_pool.clone()
    with knobs.override(MSTAR_PDL=False):
        want = chain(x0, res0)
        want_pools = conv_pool.clone(), gdn_pool.clone()
    conv_pool.copy_(pools[0])
    gdn_pool.copy_(pools[1])
    with knobs.override(MSTAR_PDL=True):
        assert pdl.launch_options(x0)["PDL"] == supported
        chain(x0, res0)  # compile outside the capture
        conv_pool.copy_(pools[0])
        gdn_pool.copy_(pools[1])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(x0, res0)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got + (conv_pool, gdn_pool), want + want_pools):
        assert torch.equal(a, b)


def test_verify_mode_on_gpu():
    x, w = r(64, 1024, dtype=torch.bfloat16), r(1024, dtype=torch.bfloat16)
    ops.reset_verify_report()
    with knobs.override(MSTAR_VERIFY=True):
        ops.rms_norm(x, w, 1e-6, True)
    rep = ops.verify_report()
    if _fast_backends("rms_norm"):
        assert rep["rms_norm"]["calls"] == 1 and rep["rms_norm"]["max_abs_diff"] < 0.1
