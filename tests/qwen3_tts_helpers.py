"""A tiny random Qwen3-TTS 12 Hz checkpoint in the release's layout, built by the reference package
(qwen-tts 0.1.1, in its own environment: tests/reference_envs.py), and the package's outputs on it.

`build_reference(dir, cases)` runs one script in the reference environment that
  - builds a byte-level BPE tokenizer with Qwen2's pre-tokenizer (merges make "assistant" and
    "user" one token each, as in the release's vocabulary) and the special tokens the prompt needs,
    saved as the release's tokenizer files;
  - instantiates Qwen3TTSForConditionalGeneration from TINY_CONFIG with a fixed torch seed (the EOS
    row of the codebook-0 head scaled up, so that greedy rows end at different frames) and
    save_pretrained's it, with a generation_config.json like the release's;
  - computes the talker's logits on random input embeddings (prefill, then decode steps; each row
    alone) and the code predictor's logits on random inputs;
  - runs the package's own entry points (Qwen3TTSModel.generate_custom_voice /
    generate_voice_design, the speech tokenizer replaced by one that hands back the codes) for
    each case, recording the talker's prompt embeddings, and returns the codes;
  - does the same with a variant whose EOS is far likelier (min_new_tokens decides where rows end).
"""

from __future__ import annotations

TEXT_VOCAB = 300
SPECIAL_IDS = {"<|endoftext|>": 280, "<|im_start|>": 281, "<|im_end|>": 282, "<tts_pad>": 283,
               "<tts_text_bos>": 284, "<tts_text_eod>": 285}
CODEC_EOS = 1050

TINY_CONFIG = dict(
    tts_model_type="custom_voice", tts_model_size="1b7", tokenizer_type="qwen3_tts_tokenizer_12hz",
    im_start_token_id=281, im_end_token_id=282, tts_pad_token_id=283, tts_bos_token_id=284, tts_eos_token_id=285,
    talker_config=dict(
        vocab_size=1072, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1000000,
        rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        num_code_groups=16, text_hidden_size=32, text_vocab_size=TEXT_VOCAB, codec_eos_token_id=CODEC_EOS,
        codec_think_id=1054, codec_nothink_id=1055, codec_think_bos_id=1056, codec_think_eos_id=1057,
        codec_pad_id=1048, codec_bos_id=1049, spk_id={"aiden": 1060, "eric": 1061, "vivian": [1062]},
        spk_is_dialect={"aiden": False, "eric": "sichuan_dialect", "vivian": False},
        codec_language_id={"english": 1000, "chinese": 1001, "sichuan_dialect": 1002},
        code_predictor_config=dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, rope_theta=1000000, num_code_groups=16)))

GENERATION_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                     "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50,
                     "subtalker_top_p": 1.0, "max_new_tokens": 8192}

REFERENCE_SCRIPT = r'''
import json, os
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.cache_utils import DynamicCache
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration
from qwen_tts.core.models.processing_qwen3_tts import Qwen3TTSProcessor
from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel

torch.set_num_threads(1)  # tiny tensors
d = ARGS["dir"]
# --- the tokenizer: bytes (GPT-2's byte -> char table), a few merges, the specials ------------------
keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
chars, extra = [], 0
for b in range(256):
    if b in keep:
        chars.append(chr(b))
    else:
        chars.append(chr(256 + extra)); extra += 1
vocab = {c: i for i, c in enumerate(chars)}
merges = [("a", "s"), ("as", "s"), ("i", "s"), ("t", "a"), ("n", "t"), ("ta", "nt"), ("ass", "is"),
          ("assis", "tant"), ("u", "s"), ("us", "e"), ("use", "r")]
for a, b in merges:
    vocab[a + b] = len(vocab)
for name, i in ARGS["specials"].items():
    vocab[name] = i
regex = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                           fuse_unk=False, byte_fallback=False))
tok.normalizer = normalizers.NFC()
tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ARGS["specials"]])
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               unk_token=None, clean_up_tokenization_spaces=False)
fast.save_pretrained(d)
with open(os.path.join(d, "tokenizer_config.json")) as f:
    tc = json.load(f)
tc["tokenizer_class"] = "Qwen2Tokenizer"
with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump(tc, f, indent=2)
with open(os.path.join(d, "vocab.json"), "w") as f:
    json.dump(vocab, f)
with open(os.path.join(d, "merges.txt"), "w") as f:
    f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
tokenizer = AutoTokenizer.from_pretrained(d)

# --- the model ------------------------------------------------------------------------------------
torch.manual_seed(ARGS["seed"])
model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**ARGS["config"])).eval()
eos = model.config.talker_config.codec_eos_token_id
with torch.no_grad():
    model.talker.codec_head.weight[eos] *= ARGS["eos_scale"]
model.save_pretrained(d)
with open(os.path.join(d, "generation_config.json"), "w") as f:
    json.dump(ARGS["generation_config"], f)
out = {"tokens": {t: tokenizer(t)["input_ids"] for t in ARGS["probe_texts"]}}

# --- logits on random inputs ----------------------------------------------------------------------
talker, cp = model.talker, model.talker.code_predictor
g = torch.Generator().manual_seed(1)
H = talker.config.hidden_size
rows = []
with torch.no_grad():
    for n in ARGS["talker_lengths"]:
        x = torch.randn(1, n, H, generator=g)
        steps = torch.randn(1, ARGS["talker_decode_steps"], H, generator=g)
        cache = DynamicCache()
        o = talker.model(inputs_embeds=x, past_key_values=cache, use_cache=True)
        logits = [talker.codec_head(o.last_hidden_state)[0]]
        for s in range(steps.shape[1]):
            o = talker.model(inputs_embeds=steps[:, s:s + 1], past_key_values=cache, use_cache=True)
            logits.append(talker.codec_head(o.last_hidden_state)[0])
        rows.append({"prefill": x[0], "decode": steps[0], "logits": torch.cat(logits)})
    out["talker"] = rows
    rows = []
    G = cp.config.num_code_groups
    for _ in range(2):
        x = torch.randn(1, G, H, generator=g)
        cache = DynamicCache()
        o = cp.model(inputs_embeds=cp.small_to_mtp_projection(x[:, :2]), past_key_values=cache, use_cache=True)
        logits = [cp.lm_head[0](o.last_hidden_state[:, -1])]
        for j in range(2, G):
            o = cp.model(inputs_embeds=cp.small_to_mtp_projection(x[:, j:j + 1]), past_key_values=cache,
                         use_cache=True)
            logits.append(cp.lm_head[j - 1](o.last_hidden_state[:, -1]))
        rows.append({"inputs": x[0], "logits": torch.cat(logits)})
    out["predictor"] = rows

# --- the package's generation ---------------------------------------------------------------------
class CodesBack:  # stands in for the speech tokenizer: "decodes" a row to its codes
    def decode(self, items):
        return [it["audio_codes"].clone() for it in items], 24000

model.load_speech_tokenizer(CodesBack())
wrapper = Qwen3TTSModel(model, Qwen3TTSProcessor(tokenizer=tokenizer), generate_defaults=ARGS["generation_config"])
recorded = []
talker_generate = talker.generate
def recording_generate(**kw):
    recorded.append({k: kw[k].clone() for k in ("inputs_embeds", "attention_mask", "trailing_text_hidden")})
    return talker_generate(**kw)
talker.generate = recording_generate
def run_cases(cases):
    results = []
    for case in cases:
        recorded.clear()
        kw = dict(text=case["text"], language=case["language"], non_streaming_mode=case["non_streaming"],
                  do_sample=False, subtalker_dosample=False, max_new_tokens=case["max_new_tokens"])
        if case["kind"] == "custom_voice":
            model.tts_model_type = "custom_voice"
            codes, _ = wrapper.generate_custom_voice(speaker=case["speaker"], instruct=case["instruct"], **kw)
        else:
            model.tts_model_type = "voice_design"
            codes, _ = wrapper.generate_voice_design(instruct=case["instruct"], **kw)
        r = recorded[0]
        mask = r["attention_mask"].bool()
        results.append({"codes": codes, "prompt": [r["inputs_embeds"][i][mask[i]] for i in range(mask.shape[0])],
                        "trailing": r["trailing_text_hidden"]})
    return results

out["cases"] = run_cases(ARGS["cases"])
# the same model with EOS far likelier: rows end as soon as min_new_tokens lets them
heavy = ARGS["eos_heavy"]
with torch.no_grad():
    talker.codec_head.weight[eos] *= heavy["scale"]
model.tts_model_type = "custom_voice"
model.save_pretrained(heavy["dir"])
out["eos_heavy"] = run_cases(heavy["cases"])
RESULT = out
'''


def build_reference(directory: str, cases: list[dict], *, probe_texts=(), talker_lengths=(7, 4),
                    talker_decode_steps: int = 3, seed: int = 0, eos_scale: float = 1.0, eos_heavy: dict | None = None
                    ) -> dict:
    """Write the tiny checkpoint to `directory` and return the reference package's outputs (see the
    module docstring): {"tokens", "talker", "predictor", "cases", "eos_heavy"}. eos_heavy: {"dir",
    "scale", "cases"}: the checkpoint again, its EOS head row scaled by `scale` once more, saved to
    "dir" (config and weights only), and its codes on "cases"."""
    from reference_envs import reference_env, run_reference
    args = {"dir": directory, "config": TINY_CONFIG, "generation_config": GENERATION_CONFIG, "specials": SPECIAL_IDS,
            "seed": seed, "eos_scale": eos_scale, "probe_texts": list(probe_texts),
            "talker_lengths": list(talker_lengths), "talker_decode_steps": talker_decode_steps, "cases": cases,
            "eos_heavy": eos_heavy or {"dir": directory + "-eos", "scale": 1.0, "cases": []}}
    return run_reference(reference_env("qwen-tts"), REFERENCE_SCRIPT, args)
