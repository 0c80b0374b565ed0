"""Test-only: tiny random transformers models (the reference) saved as HF checkpoints,
and the check that mstar reproduces their logits through prefill, decode and mixed steps."""

from __future__ import annotations

import math

import torch

from model_harness import Harness, rel_err

TOL = 1e-4  # relative (max abs diff / max abs reference logit)


def qwen3_5_config(tied: bool, vocab: int = 512, key_dim: int = 32, value_dim: int = 48):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # GQA 2:1
        linear_num_key_heads=2, linear_num_value_heads=4,  # value heads = 2 x key heads
        linear_key_head_dim=key_dim, linear_value_head_dim=value_dim, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention",
                     "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tied, eos_token_id=[2, 3])


def qwen3_config(tied: bool, vocab: int = 512):
    from transformers import Qwen3Config
    return Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tied, eos_token_id=2)


def make_hf_model(config, seed: int = 0):
    """A transformers CausalLM with every parameter random (norm weights too, so that a
    zero-centred vs plain norm mix-up shows), in float32, eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
            elif "norm" in name:  # zero-centred norms around 0, plain / gated around 1
                base = 0.0 if config.model_type.startswith("qwen3_5") and "linear_attn.norm" not in name else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


# transformers' Qwen3.5 on its plain-torch functions even where fla / causal_conv1d are installed
# (they need a GPU; our reference runs on the CPU): the gate's context manager
from mstar.bench.gate import torch_only_reference  # noqa: E402


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of HF over the whole sequence [len, vocab] (float32)."""
    with torch_only_reference():
        return model(torch.tensor([ids])).logits[0].float()


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_prefill_then_decode(hf, model, lengths: list[int], decode_steps: int, vocab: int, page_size: int = 4,
                              tol: float = TOL):
    """All prompts prefilled in one step, then `decode_steps` steps decoding every sequence."""
    seqs = {i: random_tokens(n + decode_steps, vocab, seed=100 + i) for i, n in enumerate(lengths)}
    ref = {i: hf_logits(hf, s) for i, s in seqs.items()}
    h = Harness(model, max_seqs=len(lengths), max_len=max(lengths) + decode_steps, page_size=page_size)
    out = h.step(prefill={i: seqs[i][:n] for i, n in enumerate(lengths)})
    for i, n in enumerate(lengths):
        e = rel_err(out[i], ref[i][:n])
        assert e < tol, f"prefill seq {i} (len {n}): rel err {e:.2e}"
    for step in range(decode_steps):
        out = h.step(decode={i: seqs[i][n + step] for i, n in enumerate(lengths)})
        for i, n in enumerate(lengths):
            e = rel_err(out[i], ref[i][n + step:n + step + 1])
            assert e < tol, f"decode step {step} seq {i}: rel err {e:.2e}"


def check_mixed(hf, model, vocab: int, page_size: int = 4, tol: float = TOL):
    """Steps mixing decode rows with prefill rows, including a chunked prefill that continues
    a sequence's history and a sequence that starts mid-run."""
    seqs = {0: random_tokens(12, vocab, 1), 1: random_tokens(9, vocab, 2), 2: random_tokens(80, vocab, 3),
            3: random_tokens(20, vocab, 4)}
    ref = {i: hf_logits(hf, s) for i, s in seqs.items()}
    h = Harness(model, max_seqs=4, max_len=80, page_size=page_size)
    got: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}

    def run(decode=None, prefill=None):
        for i, lg in h.step(decode=decode, prefill=prefill).items():
            got[i].append(lg)

    run(prefill={0: seqs[0][:7], 1: seqs[1][:5], 2: seqs[2][:30]})  # 2: first chunk
    run(decode={0: seqs[0][7], 1: seqs[1][5]}, prefill={2: seqs[2][30:75], 3: seqs[3][:11]})  # 2: next chunk
    run(decode={0: seqs[0][8], 1: seqs[1][6], 3: seqs[3][11]}, prefill={2: seqs[2][75:80]})
    # prefill rows continuing sequences that were decoding
    run(decode={3: seqs[3][12]}, prefill={0: seqs[0][9:12], 1: seqs[1][7:9]})
    for i in seqs:
        lg = torch.cat(got[i], 0)
        n = lg.shape[0]
        e = rel_err(lg, ref[i][:n])
        assert e < tol, f"mixed seq {i}: rel err {e:.2e}"
