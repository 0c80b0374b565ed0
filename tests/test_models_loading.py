"""Checkpoint loading (errors, VL layout, MTP), presets, `python -m mstar.models info`,
random weights and the built-in byte tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import hf_logits, make_hf_model, qwen3_5_config, random_tokens
from model_harness import Harness, rel_err
from mstar.models import WeightLoadError, load_model, load_tokenizer, resolve_config
from mstar.models import presets

VOCAB = 512


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_hf_model(qwen3_5_config(tied=False, vocab=VOCAB), seed=5)
    d = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(d)
    return hf, d


def _copy_with(src, dst, edit):
    """Copy checkpoint dir src to dst with its tensors edited by edit(dict) -> dict."""
    os.makedirs(dst, exist_ok=True)
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


def test_wrong_shape_names_the_tensor(hf_and_dir, tmp_path):
    _, d = hf_and_dir
    name = "model.layers.2.self_attn.k_proj.weight"

    def edit(t):
        t[name] = t[name][:-1].clone()
        return t
    _copy_with(d, tmp_path, edit)
    with pytest.raises(WeightLoadError) as e:
        load_model(str(tmp_path), progress=False)
    msg = str(e.value)
    assert name in msg and "[128, 128]" in msg and "[127, 128]" in msg


def test_missing_tensor_is_named(hf_and_dir, tmp_path):
    _, d = hf_and_dir
    name = "model.layers.0.linear_attn.A_log"

    def edit(t):
        del t[name]
        return t
    _copy_with(d, tmp_path, edit)
    with pytest.raises(WeightLoadError, match="missing 1 tensors: " + name.replace(".", r"\.")):
        load_model(str(tmp_path), progress=False)


def test_missing_files_and_unknown_names(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="neither a directory nor a preset"):
        resolve_config("no-such-model")
    with pytest.raises(ValueError, match="random_weights=True"):
        load_model("qwen3.5-0.8b")


def test_vl_checkpoint_layout(hf_and_dir, tmp_path, caplog):
    """A Qwen3.5 VL-style checkpoint: top-level config with text_config, text weights under
    model.language_model., a vision tower (skipped), MTP weights (kept)."""
    hf, d = hf_and_dir

    def edit(t):
        out = {}
        for k, v in t.items():
            out[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
        out["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
        out["model.visual.merger.linear_fc1.weight"] = torch.randn(8, 8)
        out["mtp.fc.weight"] = torch.randn(128, 256)
        out["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(256, 128)
        return out
    text_cfg = _copy_with(d, tmp_path, edit)
    eos = text_cfg.pop("eos_token_id")
    text_cfg["model_type"] = "qwen3_5_text"
    top = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": text_cfg, "vision_config": {"depth": 1}, "tie_word_embeddings": False,
           "image_token_id": 248056}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(top, f)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": eos + [7]}, f)
    with caplog.at_level("INFO", logger="mstar.models"):
        model = load_model(str(tmp_path), progress=False)
    assert sum("vision" in r.getMessage() for r in caplog.records) == 1
    assert sorted(model.mtp_weights) == ["fc.weight", "layers.0.mlp.up_proj.weight"]
    assert model.eos_token_ids == (2, 3, 7)
    assert resolve_config(str(tmp_path)).model_type == "qwen3_5_text"
    ids = random_tokens(9, VOCAB, 11)
    assert rel_err(Harness(model).step(prefill={0: ids})[0], hf_logits(hf, ids)) < 1e-4
    # load_weights on its own also skips vision tensors and rewrites the prefixes
    model.load_weights(edit(load_file(os.path.join(d, "model.safetensors"))).items())


def test_random_weights_are_deterministic(hf_and_dir):
    _, d = hf_and_dir
    a = load_model(str(d), random_weights=True, seed=3)
    b = load_model(str(d), random_weights=True, seed=3)
    c = load_model(str(d), random_weights=True, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    la = a.model.layers[0].linear_attn
    assert torch.all(la.A_log.exp() <= 16) and torch.all(a.model.norm.weight == 0)


def test_random_weights_of_a_preset_in_target_dtype():
    m = load_model("tiny-qwen3.5", dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in m.parameters())
    ref = load_model("tiny-qwen3.5")
    assert torch.equal(m.model.embed_tokens.weight, ref.model.embed_tokens.weight.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3"])
def test_tiny_models_generate_varied_text(name):
    model, tok = load_model(name), load_tokenizer(name)
    assert set(model.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"),
                                        tok.convert_tokens_to_ids("<|endoftext|>")}
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                  tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    h = Harness(model, max_len=128)
    logits = h.step(prefill={0: ids})[0][-1]
    out = []
    for _ in range(24):
        out.append(int(logits.argmax()))
        logits = h.step(decode={0: out[-1]})[0][-1]
    assert len(set(out)) > 6, out


# Published text-model parameter counts (billions): Qwen3.5 0.8B is 0.752 B; Qwen3 model cards.
@pytest.mark.parametrize("name,billions,tol", [
    ("qwen3.5-0.8b", 0.752, 0.001), ("qwen3.5-2b", 1.9, 0.1), ("qwen3.5-4b", 4.2, 0.2),
    ("qwen3.5-9b", 9.0, 0.2), ("qwen3.5-27b", 27.0, 0.5),
    ("qwen3-0.6b", 0.6, 0.01), ("qwen3-1.7b", 1.7, 0.03), ("qwen3-4b", 4.0, 0.05), ("qwen3-8b", 8.2, 0.05)])
def test_preset_parameter_counts(name, billions, tol):
    from mstar.models import build_model
    model = build_model(resolve_config(name), device="meta")
    assert abs(model.num_parameters() / 1e9 - billions) <= tol


def test_preset_matches_transformers_count():
    """Our 0.8b model has exactly the parameters transformers builds for the same config."""
    from transformers import AutoModelForCausalLM
    from mstar.models import build_model
    cfg = resolve_config("qwen3.5-0.8b")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    ours = build_model(cfg, device="meta")
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert {k: s.shape for k, s in ours.expected_weights().items()} == theirs
    assert ours.num_parameters() == 752_393_024


def test_all_presets_resolve():
    for name in presets.names():
        cfg = resolve_config(name)
        assert cfg.model_type in ("qwen3_5_text", "qwen3", "llama", "whisper", "kokoro", "wan", "cosmos3",
                                  "qwen3_tts")
        if name.startswith("qwen3.5"):
            assert cfg.vocab_size == 248320 and cfg.layer_types[3] == "full_attention"
        elif cfg.model_type == "qwen3" and name.startswith("qwen3-"):
            assert cfg.vocab_size == 151936


def test_info_cli():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "mstar.models", "info", "qwen3.5-0.8b"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "752,393,024" in out and "LLLF x 6" in out
    assert "KV cache per token (bf16): 12,288 B" in out  # 6 layers * 2 * 2 heads * 256 * 2 B
    # 18 GDN layers * (conv 6144 * 3 * 2 B + state 16 * 128 * 128 * 2 B: bf16, as the weights)
    assert f"{18 * (6144 * 3 * 2 + 16 * 128 * 128 * 2):,} B" in out


def test_byte_tokenizer_round_trip_and_chat_template():
    tok = load_tokenizer("tiny-qwen3.5")
    for text in ["hello", "héllo wörld — 日本語 🙂", "\x00\x01\n\t", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == presets.TINY_IM_END
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"]) == [256, 257]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 257 and ids.count(258) == 2
    assert tok.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi\nassistant\n"


def test_tokenizer_saved_with_a_checkpoint_loads_from_the_dir(tmp_path):
    load_tokenizer("tiny-qwen3").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.decode(tok.encode("ok ✓", add_special_tokens=False)) == "ok ✓"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).startswith("<|im_start|>")
