"""Op benchmark cases at the served models' shapes: Qwen3.5-0.8B and 4B, decode batch 1 / 32 / 128
and a 2048-token prefill on CUDA, and the Wan2.2 TI2V-5B transformer's modulation ops and q / k norm
+ rotary at a batch of two videos of 3510 tokens; smaller token counts on CPU so `pytest
mstar/bench/ops` stays quick there.

A case builds fresh random inputs for one op and says how many bytes it must move at least
(each input read once, each output written once) and how many floating-point operations it
does, so a row can report GB/s, TFLOP/s and the fraction of the measured H200 ceilings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# The H200's ceilings the rows are reported against: device-to-device copy bandwidth and dense
# bf16 matmul throughput, as measured on an H200 host (2026-11-30).
H200_COPY_GBPS = 4300.0
H200_BF16_TFLOPS = 790.0

ROWS: list[dict] = []  # one dict per timed (op, case, backend); conftest.py prints and writes them


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Shape:
    """The dims of one model that the ops see (from the preset configs)."""
    name: str
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int
    vocab: int


# Qwen3.5 text shapes (published configs; mstar.models.presets holds the full configs).
SHAPES = (
    Shape("qwen3.5-0.8b", hidden=1024, intermediate=3584, q_heads=8, kv_heads=2, head_dim=256, rotary_dim=64,
          gdn_k_heads=16, gdn_v_heads=16, gdn_k_dim=128, gdn_v_dim=128, conv_kernel=4, vocab=248320),
    Shape("qwen3.5-4b", hidden=2560, intermediate=9216, q_heads=16, kv_heads=4, head_dim=256, rotary_dim=64,
          gdn_k_heads=16, gdn_v_heads=32, gdn_k_dim=128, gdn_v_dim=128, conv_kernel=4, vocab=248320),
)


@dataclass
class Case:
    op: str
    label: str  # e.g. "qwen3.5-0.8b decode bs32"
    make_args: Callable[[], tuple]  # fresh inputs (called once before timing)
    bytes: float
    flops: float


def _sizes(device: str) -> dict:
    if device == "cuda":
        return {"decode": (1, 32, 128), "prefill": 2048, "context": 512, "page": 16}
    return {"decode": (1, 32), "prefill": 128, "context": 128, "page": 16}


def _paged_kv(batch: int, ctx: int, kvh: int, d: int, page: int, dtype, device):
    pages_per = math.ceil(ctx / page)
    n_pages = batch * pages_per
    k_cache = torch.randn(n_pages, page, kvh, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(n_pages, device=device).to(torch.int32)
    indptr = torch.arange(0, n_pages + 1, pages_per, dtype=torch.int32, device=device)
    last = torch.full((batch,), ctx - (pages_per - 1) * page, dtype=torch.int32, device=device)
    return k_cache, v_cache, indptr, perm, last


def _fused_linear_cases(s: Shape, b: int, lab: str, rnd, es: int, conv_channels: int) -> list[Case]:
    """The fused-linear ops at a decode batch: the norm + GDN input projection, SiLU-and-mul + down, the
    gated norm + GDN out_proj, the sigmoid gate + o_proj (the kernel's rows at batch 1, composed above)."""
    def w(n, k):
        return rnd(n, k) * k ** -0.5

    n_in, hv, q = conv_channels + s.gdn_v_heads * (s.gdn_v_dim + 2), s.gdn_v_heads, s.q_heads * s.head_dim
    i, v = s.intermediate, s.gdn_v_heads * s.gdn_v_dim

    def gate_view(heads, d):
        return rnd(b, heads, 2 * d)[..., d:]

    return [
        Case("add_rms_norm_linear", lab, lambda: (rnd(b, s.hidden), rnd(b, s.hidden), rnd(s.hidden), 1e-6, True,
                                                   w(n_in, s.hidden)),
             bytes=(n_in * s.hidden + 3 * b * s.hidden + b * n_in) * es, flops=2 * b * n_in * s.hidden),
        Case("silu_mul_linear", lab, lambda: (rnd(b, 2 * i), w(s.hidden, i)),
             bytes=(s.hidden * i + 2 * b * i + b * s.hidden) * es, flops=2 * b * s.hidden * i),
        Case("gated_rms_norm_linear", lab, lambda: (rnd(b, hv, s.gdn_v_dim), gate_view(hv, s.gdn_v_dim),
                                                     rnd(s.gdn_v_dim), 1e-6, w(s.hidden, v)),
             bytes=(s.hidden * v + 2 * b * v + b * s.hidden) * es, flops=2 * b * s.hidden * v),
        Case("sigmoid_mul_linear", lab, lambda: (rnd(b, s.q_heads, s.head_dim), gate_view(s.q_heads, s.head_dim),
                                                  w(s.hidden, q)),
             bytes=(s.hidden * q + 2 * b * q + b * s.hidden) * es, flops=2 * b * s.hidden * q),
    ]


def build_cases(device: str, dtype: torch.dtype) -> list[Case]:
    sz = _sizes(device)
    es = torch.empty((), dtype=dtype).element_size()
    dev = device
    cases: list[Case] = []

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt, device=dev)

    for s in SHAPES:
        token_counts = [(f"decode bs{b}", b) for b in sz["decode"]] + [(f"prefill {sz['prefill']}", sz["prefill"])]
        for tag, t in token_counts:
            lab = f"{s.name} {tag}"
            h = s.hidden
            cases.append(Case("rms_norm", lab, lambda t=t, h=h: (rnd(t, h), rnd(h), 1e-6, True),
                              bytes=(2 * t * h + h) * es, flops=4 * t * h))
            cases.append(Case("fused_add_rms_norm", lab, lambda t=t, h=h: (rnd(t, h), rnd(t, h), rnd(h), 1e-6, True),
                              bytes=(4 * t * h + h) * es, flops=5 * t * h))
            hv, dv = s.gdn_v_heads, s.gdn_v_dim
            cases.append(Case("gated_rms_norm", lab,
                              lambda t=t, hv=hv, dv=dv: (rnd(t * hv, dv), rnd(t * hv, dv), rnd(dv), 1e-6),
                              bytes=(3 * t * hv * dv + dv) * es, flops=8 * t * hv * dv))
            hk, dk = s.gdn_k_heads, s.gdn_k_dim
            cases.append(Case("l2_norm", lab, lambda t=t, hk=hk, dk=dk: (rnd(t, hk, dk), 1e-6),
                              bytes=2 * t * hk * dk * es, flops=3 * t * hk * dk))
            i = s.intermediate
            cases.append(Case("silu_and_mul", lab, lambda t=t, i=i: (rnd(t, 2 * i),),
                              bytes=3 * t * i * es, flops=5 * t * i))
            cases.append(Case("rotary_embedding", lab,
                              lambda t=t, s=s: (torch.randint(0, 4096, (t,), device=dev), rnd(t, s.q_heads, s.head_dim),
                                                rnd(t, s.kv_heads, s.head_dim),
                                                rnd(4096, s.rotary_dim, dt=torch.float32), s.rotary_dim),
                              bytes=2 * t * (s.q_heads + s.kv_heads) * s.head_dim * es + t * s.rotary_dim * 4,
                              flops=3 * t * (s.q_heads + s.kv_heads) * s.rotary_dim))
            cases.append(Case("qk_norm_rope", lab, lambda t=t, s=s: (
                rnd(t, (2 * s.q_heads + 2 * s.kv_heads) * s.head_dim), torch.randint(0, 4096, (t,), device=dev),
                rnd(s.head_dim), rnd(s.head_dim), rnd(4096, s.rotary_dim, dt=torch.float32), s.q_heads, s.kv_heads,
                s.head_dim, s.rotary_dim, 1e-6, True, True),
                bytes=2 * t * (s.q_heads + 2 * s.kv_heads) * s.head_dim * es + t * s.rotary_dim * 4,
                flops=6 * t * (s.q_heads + s.kv_heads) * s.head_dim))
            cases.append(Case("kv_append", lab, lambda t=t, s=s: (
                rnd(t, s.kv_heads, s.head_dim), rnd(t, s.kv_heads, s.head_dim),
                rnd(t // sz["page"] + 2, sz["page"], s.kv_heads, s.head_dim),
                rnd(t // sz["page"] + 2, sz["page"], s.kv_heads, s.head_dim),
                torch.randperm((t // sz["page"] + 2) * sz["page"], device=dev)[:t]),
                bytes=4 * t * s.kv_heads * s.head_dim * es, flops=0))
            n_pages = t // sz["page"] + 2
            cases.append(Case("qk_norm_rope_append", lab, lambda t=t, s=s, n_pages=n_pages: (
                rnd(t, (2 * s.q_heads + 2 * s.kv_heads) * s.head_dim), torch.randint(0, 4096, (t,), device=dev),
                rnd(s.head_dim), rnd(s.head_dim), rnd(4096, s.rotary_dim, dt=torch.float32), s.q_heads, s.kv_heads,
                s.head_dim, s.rotary_dim, 1e-6, True, True, rnd(n_pages, sz["page"], s.kv_heads, s.head_dim),
                rnd(n_pages, sz["page"], s.kv_heads, s.head_dim),
                torch.randperm(n_pages * sz["page"], device=dev)[:t]),
                bytes=2 * t * (s.q_heads + 2 * s.kv_heads) * s.head_dim * es + t * s.rotary_dim * 4,
                flops=6 * t * (s.q_heads + s.kv_heads) * s.head_dim))
            cases.append(Case("sigmoid_mul", lab, lambda t=t, s=s: (
                rnd(t, s.q_heads, s.head_dim), rnd(t, s.q_heads, 2 * s.head_dim)[..., s.head_dim:]),
                bytes=3 * t * s.q_heads * s.head_dim * es, flops=5 * t * s.q_heads * s.head_dim))
            c = s.gdn_k_heads * s.gdn_k_dim * 2 + s.gdn_v_heads * s.gdn_v_dim  # conv over q, k, v
            kk = s.conv_kernel
            state_bytes = s.gdn_v_heads * s.gdn_k_dim * s.gdn_v_dim * 4
            if tag.startswith("decode"):
                b = t
                cases.append(Case("causal_conv1d_update", lab, lambda b=b, c=c, kk=kk: (
                    rnd(b, c), rnd(c, kk), rnd(c), rnd(b, c, kk - 1), torch.arange(b, device=dev), True),
                    bytes=(2 * b * c + c * kk + 2 * b * c * (kk - 1)) * es, flops=2 * b * c * kk))
                cases.append(Case("gdn_decode", lab, lambda b=b, s=s: (
                    torch.nn.functional.normalize(rnd(b, s.gdn_v_heads, s.gdn_k_dim), dim=-1),
                    torch.nn.functional.normalize(rnd(b, s.gdn_v_heads, s.gdn_k_dim), dim=-1),
                    rnd(b, s.gdn_v_heads, s.gdn_v_dim),
                    -torch.rand(b, s.gdn_v_heads, device=dev) * 0.1,
                    torch.rand(b, s.gdn_v_heads, dtype=dtype, device=dev),
                    torch.randn(b, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim, device=dev) * 0.1,
                    torch.arange(b, device=dev), s.gdn_k_dim ** -0.5),
                    bytes=2 * b * state_bytes, flops=6 * b * s.gdn_v_heads * s.gdn_k_dim * s.gdn_v_dim))
                cases.append(Case("gdn_decode_fused", lab, lambda b=b, s=s, c=c: (
                    rnd(b, c), rnd(b, s.gdn_v_heads), rnd(b, s.gdn_v_heads),
                    torch.rand(s.gdn_v_heads, device=dev).mul(15).add(0.01).log().to(dtype), rnd(s.gdn_v_heads),
                    torch.randn(b, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim, device=dev) * 0.1,
                    torch.arange(b, device=dev), s.gdn_k_heads, s.gdn_k_dim ** -0.5, 1e-6),
                    bytes=2 * b * state_bytes + b * c * es, flops=6 * b * s.gdn_v_heads * s.gdn_k_dim * s.gdn_v_dim))
                cases.extend(_fused_linear_cases(s, b, lab, rnd, es, c))
                ctx = sz["context"]
                cases.append(Case("paged_attention_decode", f"{lab} ctx{ctx}", lambda b=b, s=s, ctx=ctx: (
                    rnd(b, s.q_heads, s.head_dim),
                    *_pd(_paged_kv(b, ctx, s.kv_heads, s.head_dim, sz["page"], dtype, dev)),
                    s.head_dim ** -0.5),
                    bytes=2 * b * ctx * s.kv_heads * s.head_dim * es,
                    flops=4 * b * s.q_heads * ctx * s.head_dim))
            else:
                cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
                cases.append(Case("causal_conv1d_prefill", lab, lambda t=t, c=c, kk=kk, cu=cu: (
                    rnd(t, c), rnd(c, kk), rnd(c), rnd(1, c, kk - 1), cu, torch.zeros(1, dtype=torch.int64, device=dev),
                    torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev), True),
                    bytes=2 * t * c * es, flops=2 * t * c * kk))
                cases.append(Case("gdn_prefill", lab, lambda t=t, s=s, cu=cu: (
                    torch.nn.functional.normalize(rnd(t, s.gdn_v_heads, s.gdn_k_dim), dim=-1),
                    torch.nn.functional.normalize(rnd(t, s.gdn_v_heads, s.gdn_k_dim), dim=-1),
                    rnd(t, s.gdn_v_heads, s.gdn_v_dim),
                    -torch.rand(t, s.gdn_v_heads, device=dev) * 0.1,
                    torch.rand(t, s.gdn_v_heads, dtype=dtype, device=dev),
                    torch.zeros(1, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim, device=dev), cu,
                    torch.zeros(1, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev),
                    torch.empty(0, dtype=torch.int64, device=dev), s.gdn_k_dim ** -0.5),
                    # chunked form: per token about 4*Dk*Dv (state in/out products) + 2*64*(Dk+Dv) (intra-chunk)
                    bytes=t * s.gdn_v_heads * (2 * s.gdn_k_dim + 2 * s.gdn_v_dim) * es + 2 * state_bytes,
                    flops=t * s.gdn_v_heads * (4 * s.gdn_k_dim * s.gdn_v_dim + 128 * (s.gdn_k_dim + s.gdn_v_dim))))
                # the same rows from the conv output: split, norms and gates inside the op (fused or composed)
                cases.append(Case("gdn_prefill_fused", lab, lambda t=t, s=s, c=c, cu=cu: (
                    rnd(t, c), rnd(t, s.gdn_v_heads), rnd(t, s.gdn_v_heads),
                    torch.rand(s.gdn_v_heads, device=dev).mul(15).add(0.01).log().to(dtype), rnd(s.gdn_v_heads),
                    torch.zeros(1, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim, device=dev), cu,
                    torch.zeros(1, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev),
                    torch.empty(0, dtype=torch.int64, device=dev), s.gdn_k_heads, s.gdn_k_dim ** -0.5, 1e-6),
                    bytes=t * (c + 2 * s.gdn_v_heads + s.gdn_v_heads * s.gdn_v_dim) * es + 2 * state_bytes,
                    flops=t * s.gdn_v_heads * (4 * s.gdn_k_dim * s.gdn_v_dim + 128 * (s.gdn_k_dim + s.gdn_v_dim))))
                ctx = t
                cases.append(Case("paged_attention_prefill", lab, lambda t=t, s=s: (
                    rnd(t, s.q_heads, s.head_dim), *_pp(t, s, dtype, dev), s.head_dim ** -0.5),
                    bytes=(2 * t * s.q_heads + 2 * t * s.kv_heads) * s.head_dim * es,
                    flops=2 * s.q_heads * s.head_dim * t * (t + 1)))
    cases += _sample_cases(sz["decode"], SHAPES[0].vocab, dev)
    cases += _wan_cases(dtype, dev)
    return cases


# Wan2.2 TI2V-5B's transformer: width 3072; 3510 tokens per video at 832x480, 33 frames (9 x 15 x 26
# post-patch), a batch of two (classifier-free guidance), two timesteps (the conditioning frame at 0).
WAN_DIM = 3072
WAN_HEADS = 24
WAN_TOKENS = 3510


def _wan_cases(dtype, dev) -> list[Case]:
    """modulated_layer_norm and gated_residual with per-token ([B, S]) and per-row ([B, 1]) indices;
    rms_norm_rotary on the self-attention's q (or k)."""
    b, s = (2, WAN_TOKENS) if dev == "cuda" else (1, 256)
    n, es, u = b * s * WAN_DIM, torch.empty((), dtype=dtype).element_size(), 2

    def inputs(width):
        x = torch.randn(b, s, WAN_DIM, dtype=dtype, device=dev)
        table = 0.5 * torch.randn(u, 6, WAN_DIM, device=dev)  # float32, as the model's modulation table
        return x, table, torch.randint(0, u, (b, width), device=dev)

    def norm_args(width):
        x, table, index = inputs(width)
        return x, table[:, 0], table[:, 1], index, 1e-6

    def residual_args(width):
        x, table, index = inputs(width)
        return x, torch.randn_like(x), table[:, 2], index

    out = []
    for tag, width in (("per-token", s), ("per-row", 1)):
        lab = f"wan2.2-ti2v-5b {b}x{s} {tag}"
        out.append(Case("modulated_layer_norm", lab, lambda w=width: norm_args(w),
                        bytes=2 * n * es + 2 * u * WAN_DIM * 4, flops=8 * n))
        out.append(Case("gated_residual", lab, lambda w=width: residual_args(w),
                        bytes=3 * n * es + u * WAN_DIM * 4, flops=2 * n))
    half = WAN_DIM // WAN_HEADS // 2

    def rotary_args():
        ang = torch.rand(s, half, device=dev) * 100  # float32 angles, as the model's rope tables
        return (torch.randn(b, s, WAN_DIM, dtype=dtype, device=dev),
                (1 + 0.1 * torch.randn(WAN_DIM, device=dev)).to(dtype), ang.cos(), ang.sin(), WAN_HEADS, 1e-6)

    out.append(Case("rms_norm_rotary", f"wan2.2-ti2v-5b {b}x{s}", rotary_args,
                    bytes=2 * n * es + WAN_DIM * es + 2 * s * half * 4, flops=7 * n))
    return out + _fp8_cases(b * s, dtype, dev)


WAN_FFN = 14336


def _fp8_cases(m: int, dtype, dev) -> list[Case]:
    """MSTAR_DIT_FP8's two ops at Wan's FFN down projection (GELU in the quantization), and the
    bf16 up projection with its GELU epilogue for the matrix rate they are weighed against."""
    from mstar.ops.fp8 import quantize_weight
    lab = f"wan2.2-ti2v-5b ffn {m} tokens"
    mk = m * WAN_FFN

    def quantize_args():
        return torch.randn(m, WAN_FFN, dtype=dtype, device=dev), "gelu_tanh"

    def matmul_args():
        from mstar import ops
        q, scale = ops.quantize_rows(torch.randn(m, WAN_FFN, dtype=dtype, device=dev), "gelu_tanh")
        return (q, scale, *quantize_weight(torch.randn(WAN_DIM, WAN_FFN, dtype=dtype, device=dev) / WAN_FFN ** 0.5),
                torch.randn(WAN_DIM, dtype=dtype, device=dev), dtype)

    def linear_gelu_args():
        return (torch.randn(m, WAN_DIM, dtype=dtype, device=dev),
                torch.randn(WAN_FFN, WAN_DIM, dtype=dtype, device=dev) / WAN_DIM ** 0.5,
                torch.randn(WAN_FFN, dtype=dtype, device=dev), "tanh")

    es = torch.empty((), dtype=dtype).element_size()
    return [Case("quantize_rows", lab, quantize_args, bytes=mk * (es + 1) + 4 * m, flops=12 * mk),
            Case("fp8_matmul", lab, matmul_args, bytes=mk + WAN_DIM * WAN_FFN + m * WAN_DIM * es,
                 flops=2 * mk * WAN_DIM),
            Case("linear_gelu", lab, linear_gelu_args, bytes=(m * WAN_DIM + WAN_FFN * WAN_DIM + m * WAN_FFN) * es,
                 flops=2 * mk * WAN_DIM)]


# Sampler mixes: (temperature, top_k, top_p, min_p). Same vocabulary for both models, so once.
SAMPLE_MIXES = (("greedy", 0.0, 0, 1.0, 0.0), ("temperature", 0.8, 0, 1.0, 0.0), ("top-k50", 0.8, 50, 1.0, 0.0),
                ("top-p0.9", 0.8, 0, 0.9, 0.0))


def lm_logits(b: int, v: int, device) -> torch.Tensor:
    """Logits shaped like a language model's (float32 holding bf16 values, as compute_logits
    returns them): a Gaussian bulk and a heavy head of 64 tokens per row, so top-p 0.9 keeps
    tens of tokens rather than half the vocabulary (plain randn logits are far flatter)."""
    lg = torch.randn(b, v, device=device) * 2
    head = torch.randint(0, v, (b, 64), device=device)
    lg.scatter_add_(1, head, 10 + 3 * torch.randn(b, 64, device=device))
    return lg.to(torch.bfloat16).float()


def _sample_cases(batches, v: int, dev) -> list[Case]:
    out = []
    for b in batches:
        for tag, t, k, p, mp in SAMPLE_MIXES:
            out.append(Case("sample", f"vocab{v} bs{b} {tag}", lambda b=b, t=t, k=k, p=p, mp=mp: (
                lm_logits(b, v, dev), torch.full((b,), t, device=dev),
                torch.full((b,), k, dtype=torch.int64, device=dev), torch.full((b,), p, device=dev),
                torch.full((b,), mp, device=dev), torch.arange(b, dtype=torch.int64, device=dev) * 7919,
                torch.full((b,), 3, dtype=torch.int64, device=dev), 0),
                bytes=b * v * 4, flops=5 * b * v))
    return out


def _pd(kv):
    k_cache, v_cache, indptr, indices, last = kv
    return k_cache, v_cache, indptr, indices, last


def _pp(t, s, dtype, dev):
    k_cache, v_cache, indptr, indices, last = _paged_kv(1, t, s.kv_heads, s.head_dim, 16, dtype, dev)
    qo = torch.tensor([0, t], dtype=torch.int32, device=dev)
    return k_cache, v_cache, qo, indptr, indices, last


def rate_columns(case: Case, seconds: float, device: str) -> dict:
    gbps = case.bytes / seconds / 1e9
    tflops = case.flops / seconds / 1e12
    row = {"gb_s": gbps, "tflop_s": tflops}
    if device == "cuda":
        # the bound that applies: the larger of the two fractions says which ceiling is near
        row["frac_bw"] = gbps / H200_COPY_GBPS
        row["frac_flops"] = tflops / H200_BF16_TFLOPS
    return row
