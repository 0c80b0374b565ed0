"""The qwen-tts package baseline of `mstar bench speech` for Qwen3-TTS (--baseline qwen-tts).

The reference package (qwen-tts 0.1.1) at the preset's shape (--model: qwen3-tts-1.7b is the
published Qwen3-TTS-12Hz-1.7B-CustomVoice shape, tiny-qwen3-tts the test model) with random
weights, served as the package serves a batch: per point, one Qwen3TTSModel.generate_custom_voice
call on c identical requests (TEXT, SPEAKER, LANGUAGE; the whole text in the prompt, the
package's default), which generates the codes and then decodes every utterance whole with the
speech tokenizer's decode.

Length: every request makes exactly F = ceil(--seconds * 12.5) frames. The package's generate
leaves no way to pass min_new_tokens (it fixes it at 2), so the talker's generate is wrapped to
set min_new_tokens = max_new_tokens = F + 1: the codec EOS is masked at every step (transformers'
MinNewTokensLengthLogitsProcessor), and F + 1 sampled first codes give F whole frames (the last
one's residual codes are never predicted, as with an EOS).

The package pins transformers 4.57.3, so it runs in a subprocess: `qwen_tts_python` (default: this
interpreter) with `qwen_tts_path` (a `pip install --no-deps --target` directory of qwen_tts,
transformers 4.57.3 and huggingface_hub 0.36) first on PYTHONPATH. That process builds the model
and reports its timings as one JSON line on stdout; the records are made here. Modules the package
imports but generation never calls (librosa, soundfile, sox, onnxruntime, torchaudio, einops:
the 25 Hz tokenizer, audio I/O) are stubbed when they are missing, and transformers' import-time
pin check (tokenizers <= 0.23.0) is skipped; the versions that ran are in the record. The speech
tokenizer's encoder (a Mimi model, not used to decode) is built small.

The package does not stream: first audio = the time the whole generate + decode call returns, for
every request of the batch (`realtime` does not apply).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import types

TEXT = ("Hey there, my name is Aiden, and I am here to read you a short story about a fox, "
        "a dog, and a very long afternoon by the river.")
SPEAKER = "aiden"
LANGUAGE = "english"
RESULT_PREFIX = "QWEN_TTS_RESULT "
WARMUP_FRAMES = 4
# the speech tokenizer's encoder (MimiConfig), small: decoding never runs it
SMALL_ENCODER = {"audio_channels": 1, "hidden_size": 32, "num_filters": 8, "num_residual_layers": 1,
                 "upsampling_ratios": [8, 4], "codebook_size": 64, "vector_quantization_hidden_dimension": 64,
                 "upsample_groups": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                 "sliding_window": 4, "codebook_dim": 64, "use_cache": False}
IMPORT_ONLY = ("librosa.filters", "soundfile", "sox", "onnxruntime", "torchaudio.compliance.kaldi", "einops")


# -- the parent: mstar's side ------------------------------------------------------------------
def run_qwen_tts_baseline(args) -> list[dict]:
    """One record per --baseline-concurrency point (engine "qwen-tts-package"). Reads args.model
    (a qwen3_tts preset), seconds, baseline_concurrency, device, dtype, and optionally
    qwen_tts_path (the --target directory; None: the interpreter's own packages) and
    qwen_tts_python (None: sys.executable); _record reads model, seconds, dtype, no_overlap, out."""
    import torch

    from mstar.bench.speech import Stream, _record
    from mstar.models.qwen3_tts import presets
    from mstar.models.qwen3_tts.codec_config import Qwen3TTSCodecConfig

    preset = presets.get(args.model)
    if preset is None:
        raise SystemExit(f"mstar bench speech: --baseline qwen-tts runs the qwen3_tts presets only, not {args.model!r}")
    cfg = dict(preset.config)
    codec_raw, gen_cfg = cfg.pop("speech_tokenizer"), cfg.pop("generation_config")
    codec = Qwen3TTSCodecConfig.from_dict(codec_raw)
    rates = ("output_sample_rate", "decode_upsample_rate")
    decoder = {k: v for k, v in codec.to_dict().items() if v is not None and k not in rates}
    frames = math.ceil(round(args.seconds * codec.frame_rate, 6))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(args, "dtype", "auto") or "auto"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    tok = presets.byte_tokenizer()
    prompt = f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    job = {"config": cfg, "generation_config": gen_cfg, "decoder": decoder, "encoder": SMALL_ENCODER,
           "rates": {k: getattr(codec, k) for k in rates}, "frames": frames, "device": device, "dtype": dtype,
           "concurrency": list(args.baseline_concurrency), "prompt": prompt, "prompt_ids": tok(prompt)["input_ids"]}
    env = dict(os.environ)
    path = getattr(args, "qwen_tts_path", None)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(path)] + [p for p in [env.get("PYTHONPATH")] if p])
    python = getattr(args, "qwen_tts_python", None) or sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        tok.backend_tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        # -P: the script's directory (mstar/bench) stays off sys.path; stderr passes through
        p = subprocess.run([python, "-P", os.path.abspath(__file__), tmp], cwd=tmp, env=env, stdout=subprocess.PIPE,
                           text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"the qwen-tts baseline process failed ({p.returncode}):\n{p.stdout[-4000:]}")
    out = json.loads(lines[-1][len(RESULT_PREFIX):])
    records = []
    for point in out["points"]:
        if point["frames"] != [frames] * point["c"]:
            raise RuntimeError(f"qwen-tts baseline: frames {point['frames']}, asked {frames} each")
        streams = []
        for samples in point["samples"]:
            s = Stream(0.0)  # submitted at the call, its audio when the call returns
            s.chunks.append((point["wall_s"], samples / codec.output_sample_rate))
            s.t1 = point["wall_s"]
            streams.append(s)
        extra = {"frames": frames, "max_new_tokens": frames + 1, "min_new_tokens": frames + 1,
                 "decode_s": round(point["decode_s"], 3), "prompt_tokens": len(job["prompt_ids"]),
                 "speaker": SPEAKER, "language": LANGUAGE, "realtime": None, "versions": out["versions"],
                 "note": "one generate_custom_voice() batch of c (generate, then decode whole); first audio = "
                         "its return; EOS masked for F+1 steps (min_new_tokens)"}
        records.append(_record(args, "qwen-tts-package", "qwen3_tts", point["c"], streams, point["wall_s"], extra))
    return records


# -- the subprocess: the package's side --------------------------------------------------------
class _Missing(types.ModuleType):
    """A module the package imports but generation never calls: any name is a function that
    raises when called."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*a, **k):
            raise RuntimeError(f"{self.__name__}.{name}: not installed (stubbed for the benchmark)")
        return missing


def _stub_missing(dotted: str) -> bool:
    """Import `dotted`; if that fails, put stub modules for it and its parents in sys.modules."""
    try:
        importlib.import_module(dotted)
        return False
    except Exception:  # noqa: BLE001 -- missing, or installed but broken (a torchaudio of another torch)
        top = dotted.split(".")[0]
        for k in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
            del sys.modules[k]
    parts = dotted.split(".")
    parent = None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        mod = _Missing(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
        if parent is not None:
            setattr(parent, parts[i], mod)
        parent = mod
    return True


def _child(tmp: str) -> None:
    with open(os.path.join(tmp, "job.json")) as f:
        job = json.load(f)
    stubbed = [m for m in IMPORT_ONLY if _stub_missing(m)]
    check = types.ModuleType("transformers.dependency_versions_check")
    check.dep_version_check = lambda pkg, hint=None: None
    sys.modules[check.__name__] = check  # its pins refuse a newer tokenizers at import
    import tokenizers
    import torch
    import transformers
    from transformers import Qwen2TokenizerFast

    from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor

    device, dtype = torch.device(job["device"]), getattr(torch, job["dtype"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=...) builds
    try:
        with device:
            model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**job["config"])).eval()
            codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(
                encoder_config=job["encoder"], decoder_config=job["decoder"], **job["rates"])).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    speech_tokenizer = Qwen3TTSTokenizer()
    speech_tokenizer.model, speech_tokenizer.config, speech_tokenizer.device = codec, codec.config, codec.device
    model.load_speech_tokenizer(speech_tokenizer)
    tok = Qwen2TokenizerFast(tokenizer_file=os.path.join(tmp, "tokenizer.json"), eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", unk_token=None)
    processor = Qwen3TTSProcessor(tokenizer=tok)
    if processor(text=job["prompt"])["input_ids"][0] != job["prompt_ids"]:
        raise RuntimeError("the package's tokenization of the prompt differs from mstar's")
    tts = Qwen3TTSModel(model, processor, generate_defaults=job["generation_config"])

    talker_generate = model.talker.generate

    def forced_length(**kw):  # EOS masked for every step: exactly max_new_tokens first codes
        kw["min_new_tokens"] = kw["max_new_tokens"]
        return talker_generate(**kw)
    model.talker.generate = forced_length
    decode, decode_s = speech_tokenizer.decode, [0.0]

    def timed_decode(items):
        t = time.perf_counter()
        out = decode(items)
        decode_s[0] += time.perf_counter() - t
        return out
    speech_tokenizer.decode = timed_decode

    def call(c: int, frames: int):
        wavs, _ = tts.generate_custom_voice(text=[TEXT] * c, speaker=SPEAKER, language=LANGUAGE,
                                            max_new_tokens=frames + 1)
        sync()
        return wavs

    spf = job["rates"]["decode_upsample_rate"]
    points = []
    for c in job["concurrency"]:
        call(c, WARMUP_FRAMES)
        decode_s[0] = 0.0
        t = time.perf_counter()
        wavs = call(c, job["frames"])
        wall = time.perf_counter() - t
        points.append({"c": c, "wall_s": wall, "decode_s": decode_s[0], "samples": [len(w) for w in wavs],
                       "frames": [len(w) // spf for w in wavs]})
    versions = {"qwen_tts": importlib.metadata.version("qwen-tts"), "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "huggingface_hub": importlib.metadata.version("huggingface_hub"), "torch": torch.__version__, "stubbed": stubbed}
    print(RESULT_PREFIX + json.dumps({"points": points, "versions": versions}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
