"""Orpheus's two first-audio knobs on CUDA (marked `gpu`: skipped on a CPU machine).

MSTAR_SNAC_GRAPHS: the window decoder's CUDA graphs (padded to 1, 2, 4, 8 windows, on the codec's
own stream) against the same windows decoded eagerly on the default stream, on the published
SNAC 24 kHz shape (random weights, float32): within WINDOW_TOL (1e-4 of audio in [-1, 1]: cuDNN
may pick other convolution kernels for a padded batch), a second call replaying what the first
captured. MSTAR_CANDIDATE_SAMPLING and MSTAR_SNAC_GRAPHS through the engine (overlapped decode, a
tiny Orpheus with head_dim 128 for FlashInfer, bf16, the tiny SNAC preset as its codec): the
tokens of the path with both off exactly, and its audio within WINDOW_TOL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar import knobs
from mstar.models.snac.model import build_snac_decoder
from mstar.models.snac.presets import SNAC_24KHZ
from mstar.models.snac.streaming import WindowDecoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WINDOW_TOL = 1e-4


def test_window_graphs_match_the_eager_windows():
    model = build_snac_decoder(SNAC_24KHZ, device="cuda", seed=3)
    g = torch.Generator().manual_seed(4)
    eager, graphs = WindowDecoder(model), WindowDecoder(model, graphs="auto")
    assert graphs.graphs == "cuda"
    for batch in (5, 1, 5, 8):
        windows = torch.randint(0, 4096, (batch, 4, 7), generator=g)
        seeds = torch.randint(0, 2**62, (batch,), generator=g)
        want, got = eager(windows, seeds), graphs(windows, seeds)
        assert got.shape == want.shape == (batch, 8192)
        assert np.abs(got - want).max() < WINDOW_TOL and np.abs(want).max() > 1e-2
    assert graphs._forward.captures == 2  # 8 windows (for 5 and 8) and 1: the repeats replay


@pytest.fixture(scope="module")
def orpheus_dir(tmp_path_factory):
    from transformers import LlamaConfig

    from hf_models import make_hf_model
    from mstar.models.tokenizer import byte_tokenizer
    root = tmp_path_factory.mktemp("orpheus-gpu")
    cfg = LlamaConfig(vocab_size=156940, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128258, 128009],
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256})
    lm_dir = root / "orpheus-gpu-ft"
    make_hf_model(cfg, seed=5).save_pretrained(lm_dir)
    byte_tokenizer().save_pretrained(lm_dir)
    return str(lm_dir)


@pytest.mark.parametrize("knob_set", [{"MSTAR_CANDIDATE_SAMPLING": True}, {"MSTAR_SNAC_GRAPHS": True},
                                      {"MSTAR_CANDIDATE_SAMPLING": True, "MSTAR_SNAC_GRAPHS": True}],
                         ids=["candidates", "snac-graphs", "both"])
def test_knobs_keep_tokens_and_audio(orpheus_dir, knob_set):
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    from orpheus_helpers import audio, run, speech
    reqs = [("g1", "A request on the GPU.", 31, 63), ("g2", "And another, longer one.", 32, 91),
            ("g3", "Third.", 33, 35)]
    opts = dict(model=orpheus_dir, codec="snac-tiny", dtype="bfloat16", device="cuda", max_num_seqs=8,
                max_model_len=1024)
    with knobs.override(MSTAR_CANDIDATE_SAMPLING=False, MSTAR_SNAC_GRAPHS=False):
        want = run(EngineCore(EngineConfig(**opts)), [speech(*r) for r in reqs])
    with knobs.override(**{"MSTAR_CANDIDATE_SAMPLING": False, "MSTAR_SNAC_GRAPHS": False, **knob_set}):
        core = EngineCore(EngineConfig(**opts))
    assert core._candidates == bool(knob_set.get("MSTAR_CANDIDATE_SAMPLING"))
    assert core.output_stage.windows.graphs == ("cuda" if knob_set.get("MSTAR_SNAC_GRAPHS") else "off")
    got = run(core, [speech(*r) for r in reqs])
    for rid, _, _, n in reqs:
        assert got[rid]["tokens"] == want[rid]["tokens"] and len(got[rid]["tokens"]) == n
        a, b = audio(got[rid]), audio(want[rid])
        assert a.shape == b.shape and np.abs(a - b).max() < WINDOW_TOL
    if knob_set.get("MSTAR_SNAC_GRAPHS"):
        assert core.output_stage.windows._forward.captures >= 1
