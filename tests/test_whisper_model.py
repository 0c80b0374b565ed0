"""Whisper on mstar.ops against transformers' WhisperForConditionalGeneration (tiny random
checkpoint written with save_pretrained, CPU, fp32): weight names, encoder output, decoder
logits through prefill / decode / chunked steps, and greedy tokens equal to HF `generate`
(language + task forced, no timestamps, fixed number of new tokens) for a batch of clips
of different lengths. The runtime is not involved: `WhisperHarness` drives the encoder
and the decoder steps the way the runtime will (context.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model_harness import Harness, rel_err
from mstar.models.whisper import presets as whisper_presets
from mstar.models.whisper.audio import log_mel_spectrogram
from mstar.models.context import CrossAttentionMetadata, ForwardContext, ModelCaches
from mstar.models.whisper.model import build_whisper, load_whisper
from mstar.models.whisper.tokens import WhisperPromptError, WhisperTokens, apply_suppression

TOL = 1e-4
VOCAB = 51866  # the large-v3 token layout (100 languages)
TOK = WhisperTokens.from_vocab_size(VOCAB)
SUPPRESS = [1, 2, 7, 8, 9, 10, 14, 25, 221] + TOK.timestamp_ids()  # no timestamps
BEGIN_SUPPRESS = [220, TOK.eot]


def tiny_config():
    from transformers import WhisperConfig
    return WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=128, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, bos_token_id=TOK.eot, eos_token_id=TOK.eot,
        pad_token_id=TOK.eot - 1, decoder_start_token_id=TOK.sot, begin_suppress_tokens=BEGIN_SUPPRESS)


def make_hf_whisper(seed: int = 0):
    """Every parameter random (LayerNorms around 1, biases non-zero) so that a mix-up shows."""
    from transformers import WhisperForConditionalGeneration
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(tiny_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name and "encoder" in name:
                continue  # the sinusoid table
            if "layer_norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else math.prod(p.shape[1:])
                std = (2.0 if "embed_positions" in name else 1.0) if "embed" in name else 1.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    gc = model.generation_config
    gc.lang_to_id = {f"<|{c}|>": i for c, i in TOK.languages.items()}
    gc.task_to_id = {"transcribe": TOK.transcribe, "translate": TOK.translate}
    gc.no_timestamps_token_id = TOK.notimestamps
    gc.is_multilingual = True
    gc.decoder_start_token_id = TOK.sot
    gc.suppress_tokens = SUPPRESS
    gc.begin_suppress_tokens = BEGIN_SUPPRESS
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_whisper(seed=5)
    d = tmp_path_factory.mktemp("whisper")
    hf.save_pretrained(d)
    return hf, load_whisper(str(d), progress=False)


@pytest.fixture(scope="module")
def clips():
    """Three clips of different lengths (1.5 s, 7 s, 30 s) at 16 kHz: tones + noise."""
    g = np.random.default_rng(11)
    out = []
    for secs, f0 in ((1.5, 220.0), (7.0, 523.0), (30.0, 97.0)):
        t = np.arange(int(secs * 16000)) / 16000
        x = 0.3 * np.sin(2 * np.pi * f0 * t) * (1 + np.sin(2 * np.pi * 0.7 * t)) + 0.05 * g.standard_normal(t.size)
        out.append(torch.tensor(x, dtype=torch.float32))
    return out


@pytest.fixture(scope="module")
def features(clips):
    return log_mel_spectrogram(clips, n_mels=128)


# --- harness ----------------------------------------------------------------------------------
class WhisperHarness(Harness):
    """model_harness.Harness plus cross slots (randomly permuted, garbage until encoded)."""

    def __init__(self, model, *, max_seqs: int, max_len: int, page_size: int = 4, seed: int = 0):
        model.bind_caches = lambda caches: None  # bound below, once the cross pools exist
        try:
            super().__init__(model, max_seqs=max_seqs, max_len=max_len, page_size=page_size, seed=seed)
        finally:
            del model.bind_caches
        cross = self.spec.cross
        gen = torch.Generator().manual_seed(seed + 7)
        n = max_seqs + 2
        perm = torch.randperm(n, generator=gen).tolist()
        self.cross_slots = {s: perm[s] for s in range(max_seqs)}
        self.source_len = cross.max_source_len
        def shape(a):
            return (n, cross.max_source_len, a.num_kv_heads, a.head_dim)
        self.caches.cross_k_caches = [torch.randn(shape(a), generator=gen) for a in cross.layers]
        self.caches.cross_v_caches = [torch.randn(shape(a), generator=gen) for a in cross.layers]
        model.bind_caches(self.caches)

    def encode(self, seqs: list[int], features: torch.Tensor) -> torch.Tensor:
        slots = torch.tensor([self.cross_slots[s] for s in seqs])
        return self.model.encode(features, cross_slots=slots)

    def build_context(self, decode, prefill, snapshots=None) -> ForwardContext:
        ctx = super().build_context(decode, prefill, snapshots)
        rows = list(decode) + list(prefill)
        ctx.cross = CrossAttentionMetadata.for_rows(
            [self.cross_slots[s] for s in rows], [self.source_len] * len(rows),
            [1] * len(decode) + [len(prefill[s]) for s in prefill], page_size=self.spec.cross.page_size,
            pages_per_slot=self.spec.cross.pages_per_slot, device=self.device)
        return ctx


def greedy(h: WhisperHarness, prompts: dict[int, list[int]], n_new: int, start_after: dict[int, int] | None = None):
    """Greedy decoding of every sequence for n_new tokens, <|endoftext|> masked (fixed
    length), suppress / begin-suppress lists applied; sequence s joins at step
    start_after[s] (prefill rows mixed with decode rows)."""
    start_after = start_after or {}
    out: dict[int, list[int]] = {s: [] for s in prompts}
    pending: dict[int, int] = {}
    step = 0
    while any(len(v) < n_new for v in out.values()):
        prefill = {s: p for s, p in prompts.items() if start_after.get(s, 0) == step}
        decode = {s: t for s, t in pending.items() if len(out[s]) < n_new}
        logits = h.step(decode=decode, prefill=prefill)
        pending = {}
        for s, lg in logits.items():
            row = lg[-1:].clone()
            apply_suppression(row, SUPPRESS + [TOK.eot], BEGIN_SUPPRESS, [len(out[s]) == 0])
            tok = int(row.argmax(-1))
            out[s].append(tok)
            pending[s] = tok
        step += 1
    return out


# --- tests ------------------------------------------------------------------------------------
def test_weight_names_and_shapes_match_transformers(checkpoint):
    hf, model = checkpoint
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "proj_out.weight"}
    assert {k: s.shape for k, s in model.expected_weights().items()} == theirs


@pytest.mark.parametrize("name", ["whisper-large-v3", "whisper-large-v3-turbo", "whisper-tiny"])
def test_presets_match_transformers_shapes(name):
    from transformers import WhisperForConditionalGeneration
    cfg = whisper_presets.make_config(whisper_presets.get(name))
    with torch.device("meta"):
        hf = WhisperForConditionalGeneration(cfg)
    ours = build_whisper(cfg, device="meta")
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "proj_out.weight"}
    assert {k: s.shape for k, s in ours.expected_weights().items()} == theirs
    spec = ours.cache_spec()
    assert spec.cross.max_source_len == 1500 and len(spec.cross.layers) == cfg.decoder_layers
    if name == "whisper-large-v3":
        assert cfg.num_mel_bins == 128 and cfg.vocab_size == 51866
        assert spec.kv_bytes_per_token(torch.bfloat16) == 32 * 2 * 1280 * 2
        assert spec.cross_bytes_per_sequence(torch.bfloat16) == 32 * 2 * 1500 * 1280 * 2


def test_encoder_matches_transformers(checkpoint, features):
    hf, model = checkpoint
    with torch.no_grad():
        ref = hf.model.encoder(features).last_hidden_state
        ours = model.encode(features)
    assert ours.shape == ref.shape == (3, 1500, 64)
    for b in range(3):
        e = rel_err(ours[b], ref[b])
        assert e < TOL, f"clip {b}: encoder rel err {e:.2e}"


def test_decoder_logits_match_transformers(checkpoint, features):
    """Prompt prefill, then (seq 0) a chunked prefill continuing its history and
    (seqs 1, 2) token-by-token decode; seq 0 joins the decode rows at the end."""
    hf, model = checkpoint
    g = torch.Generator().manual_seed(3)
    prompts = [TOK.decoder_prompt("en"), TOK.decoder_prompt("de", "translate"),
               TOK.decoder_prompt("fr", prev_ids=[11, 22, 33, 44, 55])]
    texts = [torch.randint(0, TOK.eot, (9,), generator=g).tolist() for _ in prompts]
    seqs = [p + t for p, t in zip(prompts, texts)]
    with torch.no_grad():
        ref = [hf(input_features=features[i:i + 1], decoder_input_ids=torch.tensor([s])).logits[0]
               for i, s in enumerate(seqs)]
    h = WhisperHarness(model, max_seqs=3, max_len=32, page_size=4)
    h.encode([0, 1, 2], features)
    got = {i: [] for i in range(3)}
    n = [len(p) for p in prompts]

    def run(decode=None, prefill=None):
        for s, lg in h.step(decode=decode, prefill=prefill).items():
            got[s].append(lg)

    run(prefill={i: seqs[i][:n[i]] for i in range(3)})
    run(decode={1: seqs[1][n[1]], 2: seqs[2][n[2]]}, prefill={0: seqs[0][n[0]:n[0] + 5]})
    pos = {0: n[0] + 5, 1: n[1] + 1, 2: n[2] + 1}
    while any(pos[i] < len(seqs[i]) for i in range(3)):
        run(decode={i: seqs[i][pos[i]] for i in range(3) if pos[i] < len(seqs[i])})
        for i in range(3):
            pos[i] = min(pos[i] + 1, len(seqs[i]))
    for i in range(3):
        lg = torch.cat(got[i], 0)
        assert lg.shape[0] == len(seqs[i])
        e = rel_err(lg, ref[i])
        assert e < TOL, f"seq {i}: logits rel err {e:.2e}"


def _hf_generate(hf, feats, n_new, **kw):
    with torch.no_grad():
        out = hf.generate(feats, max_new_tokens=n_new, min_new_tokens=n_new, return_timestamps=False, **kw)
    return out.tolist()


@pytest.mark.parametrize("language,task", [("en", "transcribe"), ("de", "translate")])
def test_greedy_tokens_match_hf_generate(checkpoint, features, language, task):
    hf, model = checkpoint
    n_new = 12
    ref = _hf_generate(hf, features, n_new, language=language, task=task)
    h = WhisperHarness(model, max_seqs=3, max_len=32, page_size=4)
    h.encode([0, 1, 2], features)
    prompt = TOK.decoder_prompt(language, task)
    ours = greedy(h, {i: prompt for i in range(3)}, n_new, start_after={1: 1, 2: 3})
    for i in range(3):
        assert ours[i] == ref[i][-n_new:], f"clip {i}: {ours[i]} != HF {ref[i]}"
    assert len({tuple(v) for v in ours.values()}) > 1, "clips should decode differently"


def test_greedy_with_previous_text_prompt_matches_hf(checkpoint, features):
    hf, model = checkpoint
    n_new = 8
    prev = [1000, 2000, 3000, 4000]
    ref = _hf_generate(hf, features[:2], n_new, language="en", task="transcribe",
                       prompt_ids=torch.tensor([TOK.startofprev] + prev))
    h = WhisperHarness(model, max_seqs=2, max_len=32, page_size=4)
    h.encode([0, 1], features[:2])
    prompt = TOK.decoder_prompt("en", "transcribe", prev_ids=prev)
    assert prompt == [TOK.startofprev, *prev, TOK.sot, TOK.languages["en"], TOK.transcribe, TOK.notimestamps]
    ours = greedy(h, {0: prompt, 1: prompt}, n_new)
    for i in range(2):
        assert ours[i] == ref[i][-n_new:], f"clip {i}: {ours[i]} != HF {ref[i]}"


def test_cache_contract_errors(checkpoint):
    _, model = checkpoint
    spec = model.cache_spec()
    a = spec.attention[0]
    k = [torch.zeros(4, 4, a.num_kv_heads, a.head_dim) for _ in spec.attention]
    with pytest.raises(ValueError, match="cross-attention"):
        model.bind_caches(ModelCaches(k_caches=k, v_caches=list(k)))
    h = WhisperHarness(model, max_seqs=1, max_len=8)
    ctx = Harness.build_context(h, {}, {0: [TOK.sot]})  # no ctx.cross
    with pytest.raises(ValueError, match="ForwardContext.cross"):
        model(ctx)
    with pytest.raises(ValueError, match="log-mel"):
        model.encode(torch.zeros(1, 80, 3000))


def test_tokens_layout_and_prompts():
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    v2, v3, en = (WhisperTokens.from_vocab_size(n) for n in (51865, 51866, 51864))
    assert (v3.eot, v3.sot, v3.transcribe, v3.notimestamps, v3.timestamp_begin) == (50257, 50258, 50360, 50364, 50365)
    assert (v2.transcribe, v2.notimestamps) == (50359, 50363) and "yue" not in v2.languages
    assert v3.languages["yue"] == 50358 and list(v3.languages) == list(LANGUAGES)
    assert en.decoder_prompt(None) == [50257, 50362] and not en.multilingual
    assert v3.decoder_prompt("English") == v3.decoder_prompt("<|en|>") == [50258, 50259, 50360, 50364]
    assert v3.decoder_prompt(None) == [50258]
    assert v3.decoder_prompt("en", timestamps=True) == [50258, 50259, 50360]
    long_prev = list(range(1, 400))
    p = v3.decoder_prompt("en", prev_ids=long_prev)
    assert p[0] == v3.startofprev and len(p) == 1 + 223 + 4 and p[1:224] == long_prev[-223:]
    for bad in ("klingon", "", 3):
        with pytest.raises(WhisperPromptError):
            v3.decoder_prompt(bad)
    with pytest.raises(WhisperPromptError):
        v3.decoder_prompt("en", task="summarize")
    assert v3.text_ids([5, 6, v3.notimestamps, 7, v3.eot, 8]) == [5, 6, 7]
    logits = torch.zeros(2, 51866)
    logits[0, v3.languages["de"]] = 3.0
    logits[1, v3.languages["ja"]] = 2.0
    logits[1, 5] = 9.0  # not a language token: ignored
    assert v3.language_from_logits(logits) == ["de", "ja"]
    assert v3.max_new_tokens(4) == 444 and v3.max_new_tokens(4, 10) == 10


# --- the ops Whisper added ----------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_dense_attention_reference_and_sdpa(causal):
    from mstar import ops
    from mstar.ops.dense_attention import dense_attention_sdpa
    g = torch.Generator().manual_seed(0)
    q_lens, kv_lens = [3, 1, 7, 0], [5, 4, 7, 2]
    hq, hkv, d = 4, 2, 16
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    k = torch.randn(sum(kv_lens), hkv, d, generator=g)
    v = torch.randn(sum(kv_lens), hkv, d, generator=g)
    qi = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    ki = torch.tensor([0, *np.cumsum(kv_lens)], dtype=torch.int32)
    out = ops.dense_attention(q, k, v, qi, ki, 0.3, causal)
    for r in range(len(q_lens)):  # naive per-row, per-head softmax attention
        for j in range(q_lens[r]):
            qq = q[qi[r] + j]
            kk, vv = k[ki[r]:ki[r + 1]], v[ki[r]:ki[r + 1]]
            L = kv_lens[r]
            vis = L - q_lens[r] + j + 1 if causal else L
            for h in range(hq):
                s = (kk[:vis, h // 2] @ qq[h]) * 0.3
                want = torch.softmax(s, 0) @ vv[:vis, h // 2]
                assert torch.allclose(out[qi[r] + j, h], want, atol=1e-5)
    assert torch.allclose(dense_attention_sdpa(q, k, v, qi, ki, 0.3, causal), out, atol=1e-5)
    # equal rows: the batched path
    qe, ke = torch.randn(12, hq, d, generator=g), torch.randn(12, hkv, d, generator=g)
    ip = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    assert torch.allclose(dense_attention_sdpa(qe, ke, ke, ip, ip, 0.25, causal),
                          ops.dense_attention(qe, ke, ke, ip, ip, 0.25, causal), atol=1e-5)
    # runs of rows of one shape (guided rows of two prompt lengths): one call a run, the same attention
    ql, kl = [3, 3, 3, 2, 2], [9, 9, 6, 6, 6]
    qr, kr = torch.randn(sum(ql), hq, d, generator=g), torch.randn(sum(kl), hkv, d, generator=g)
    qri = torch.tensor([0, *np.cumsum(ql)], dtype=torch.int32)
    kri = torch.tensor([0, *np.cumsum(kl)], dtype=torch.int32)
    assert torch.allclose(dense_attention_sdpa(qr, kr, kr, qri, kri, 0.2, causal),
                          ops.dense_attention(qr, kr, kr, qri, kri, 0.2, causal), atol=1e-5)
    # the cudnn backend's kernel order (on CPU: what remains of it) gives the same attention
    from mstar.ops.dense_attention import dense_attention_cudnn
    assert torch.allclose(dense_attention_cudnn(q, k, v, qi, ki, 0.3, causal), out, atol=1e-5)
    assert torch.allclose(dense_attention_cudnn(qe, ke, ke, ip, ip, 0.25, causal),
                          ops.dense_attention(qe, ke, ke, ip, ip, 0.25, causal), atol=1e-5)


@pytest.mark.gpu
def test_dense_attention_cudnn_on_cuda():
    """cuDNN's kernel at a Wan DiT shape (2 rows of 3,510 tokens, 24 heads x 128, bf16), a
    Whisper encoder's (1,500 frames, 20 x 64) and grouped heads as Cosmos3's (16 q / 8 kv heads;
    non-causal, and causal prompts as its understanding tower runs them) against the float32
    reference."""
    from mstar import ops
    from mstar.ops.dense_attention import dense_attention_cudnn
    assert ops.dense_attention.selected("cuda") == "cudnn"
    for rows, n, h, hkv, d, causal in ((2, 3510, 24, 24, 128, False), (3, 1500, 20, 20, 64, False),
                                       (2, 900, 16, 8, 128, False), (2, 300, 16, 8, 128, True)):
        q = torch.randn(rows * n, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(rows * n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ip = torch.arange(rows + 1, dtype=torch.int32) * n
        got = dense_attention_cudnn(q, k, v, ip, ip, d ** -0.5, causal).float()
        want = ops.dense_attention.backends["reference"].fn(q, k, v, ip, ip, d ** -0.5, causal).float()
        assert (got - want).abs().max().item() < 2e-2


def test_layer_norm_ops():
    from mstar import ops
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    want = torch.nn.functional.layer_norm(x + r, (32,), w, b, 1e-5)
    assert torch.allclose(ops.layer_norm(x + r, w, b, 1e-5), want, atol=1e-6)
    y, s = ops.fused_add_layer_norm(x, r, w, b, 1e-5)
    assert torch.allclose(y, want, atol=1e-6) and torch.equal(s, x + r)
    assert ops.layer_norm(x.bfloat16(), w, b, 1e-5).dtype == torch.bfloat16


def test_preset_with_random_weights_runs():
    model = load_whisper("whisper-tiny", random_weights=True, seed=1)
    assert model.config.max_position_embeddings == 448 and model.num_mel_bins == 80
    k_bias = model.model.decoder.layers[0].self_attn.qkv_proj.bias[384:768]
    assert torch.count_nonzero(k_bias) == 0
    pos = model.model.encoder.embed_positions.weight
    assert torch.allclose(pos[:, :192], pos.new_tensor(np.sin(np.arange(1500)[:, None] * np.exp(
        -np.log(10000.0) / 191 * np.arange(192))[None, :])), atol=1e-4)
    h = WhisperHarness(model, max_seqs=1, max_len=8)
    h.encode([0], log_mel_spectrogram(torch.zeros(16000), n_mels=80))
    out = h.step(prefill={0: TOK.decoder_prompt("en")[:1] + [50259, 50359, 50363]})  # v2 ids (vocab 51865)
    assert out[0].shape == (4, 51865) and torch.isfinite(out[0]).all()
    with pytest.raises(ValueError, match="random_weights"):
        load_whisper("whisper-tiny")
    with pytest.raises(ValueError, match="neither"):
        load_whisper("whisper-enormous", random_weights=True)
