"""Test-only helpers for the Gated DeltaNet op tests: random packed inputs shaped like Qwen3.5's."""

import torch
import torch.nn.functional as F


def gdn_inputs(lens, H, Dk, Dv, gen, dtype=torch.float32):
    """(q, k, v, g, beta) for rows of these lengths packed along dim 0, and their cu_seqlens."""
    T = sum(lens)
    q = F.normalize(torch.randn(T, H, Dk, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(T, H, Dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(T, H, Dv, generator=gen, dtype=torch.float64)
    # log decays like Qwen3.5's -A * softplus(a + dt_bias): mostly mild, some heads strong
    A = torch.exp(torch.randn(H, generator=gen, dtype=torch.float64))
    g = -A * F.softplus(torch.randn(T, H, generator=gen, dtype=torch.float64) - 1.0)
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype)), cu
