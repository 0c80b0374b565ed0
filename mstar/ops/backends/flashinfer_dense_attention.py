"""dense_attention through FlashInfer's single-sequence prefill kernel (fa3 on sm90, fa2 elsewhere),
one call per row; opt-in (`MSTAR_BACKENDS=dense_attention=flashinfer`): cuDNN stays the default.

At the DiT shapes its fa3 kernel was faster than cuDNN's in a probe of the kernels alone
(notes/denoise-levers.md); its effect on a served Cosmos3 video step and its GPU accuracy test
(tests/test_flashinfer_dense_attention.py): notes/dit-fp8.md. A head dim it has no
kernel for (the VAE's 1024-wide frame attention) or a dtype other than bf16 / fp16 goes to the cuDNN
backend.
"""

from __future__ import annotations

import importlib

import flashinfer
import torch

from mstar.ops import dense_attention as op
from mstar.ops.registry import register_backend

_dense = importlib.import_module("mstar.ops.dense_attention")  # the module (mstar.ops.dense_attention is the op)
_HEAD_DIMS = (64, 128, 256)
_HALF = (torch.float16, torch.bfloat16)


def _kernel_backend(device: torch.device) -> str:
    return "fa3" if torch.cuda.get_device_capability(device) == (9, 0) else "fa2"


def dense_attention_flashinfer(q, k, v, q_indptr, kv_indptr, scale: float, causal: bool) -> torch.Tensor:
    if q.dtype not in _HALF or q.shape[-1] not in _HEAD_DIMS or k.dtype != q.dtype:
        return _dense.dense_attention_cudnn(q, k, v, q_indptr, kv_indptr, scale, causal)
    _dense._check(q, k, v, q_indptr, kv_indptr)
    qo, kvp = q_indptr.tolist(), kv_indptr.tolist()
    if len(qo) <= 1 or q.shape[0] == 0:
        return q.new_zeros(q.shape)
    backend = _kernel_backend(q.device)
    outs = []
    for i in range(len(qo) - 1):  # causal: FlashInfer aligns a row's queries to its last keys, as the op does
        q0, q1, k0, k1 = qo[i], qo[i + 1], kvp[i], kvp[i + 1]
        if q1 > q0:
            outs.append((q0, q1, flashinfer.single_prefill_with_kv_cache(q[q0:q1], k[k0:k1], v[k0:k1], causal=causal,
                                                                         sm_scale=scale, backend=backend)))
    return _dense.assemble_rows(q, qo, outs)


register_backend(op, "flashinfer", dense_attention_flashinfer, devices=("cuda",), available=torch.cuda.is_available,
                 priority=4, note="FlashInfer single prefill per row (fa3 on sm90); opt-in")
