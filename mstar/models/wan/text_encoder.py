"""The Wan text encoder: UMT5 (transformers' UMT5EncoderModel; UMT5-XXL for Wan2.2) and its
tokenizer, run once per request, with the prompt handling of diffusers' Wan pipelines
(WanPipeline._get_t5_prompt_embeds, 0.36):

    prompt_clean    ftfy.fix_text (when ftfy is installed; diffusers needs it, mstar does not:
                    without it the text is left as it is, which changes only mis-decoded text),
                    html.unescape twice, strip, runs of whitespace -> one space
    tokenize        padding to max_sequence_length (512), truncation, the tokenizer's specials
                    (UMT5: "</s>" appended), an attention mask
    encode          last_hidden_state of UMT5EncoderModel(ids, mask), in the encoder's dtype
    cut and pad     each prompt's states cut to its token count and zero-padded back to 512:
                    [B, 512, d_model], in the requested dtype

A pipeline directory holds the encoder in text_encoder/ (config.json + safetensors, transformers'
layout) and the tokenizer in tokenizer/ (AutoTokenizer). `byte_tokenizer()` is an offline
stand-in (T5's specials <pad> 0, </s> 1, <unk> 2, then the 256 bytes), for the tiny preset and
for random weights of the published shape, which has no tokenizer of its own here.
"""

from __future__ import annotations

import functools
import html
import os
import re

import torch

MAX_SEQUENCE_LENGTH = 512
BYTE_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: T5's pad / eos / unk
BYTE_VOCAB = len(BYTE_SPECIALS) + 256


def _fix_text():
    try:
        import ftfy
    except ImportError:
        return None
    return ftfy.fix_text


def prompt_clean(text: str) -> str:
    """diffusers' prompt_clean: whitespace_clean(basic_clean(text))."""
    fix = _fix_text()
    if fix is not None:
        text = fix(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


@functools.lru_cache(maxsize=1)
def _byte_tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from mstar.models.tokenizer import _byte_to_char
    vocab = {s: i for i, s in enumerate(BYTE_SPECIALS)}
    vocab.update({ch: len(BYTE_SPECIALS) + b for b, ch in enumerate(_byte_to_char())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in BYTE_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return tok.to_str()


def byte_tokenizer():
    """An offline byte-level tokenizer with T5's specials (a fresh PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_byte_tokenizer_json()),
                                  pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                  clean_up_tokenization_spaces=False)
    tok.model_max_length = MAX_SEQUENCE_LENGTH
    return tok


class WanTextEncoder:
    """UMT5 encoder + tokenizer: prompts -> [B, max_sequence_length, d_model] states."""

    def __init__(self, model, tokenizer, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_sequence_length = int(max_sequence_length)

    @property
    def dim(self) -> int:
        return int(self.model.config.d_model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def encode(self, prompts: list[str], dtype: torch.dtype | None = None) -> torch.Tensor:
        """[B, max_sequence_length, d_model] in `dtype` (default: the encoder's): each prompt's
        states up to its token count, zeros after."""
        n = self.max_sequence_length
        texts = [prompt_clean(p) for p in prompts]
        enc = self.tokenizer(texts, padding="max_length", max_length=n, truncation=True, add_special_tokens=True,
                             return_attention_mask=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        lens = mask.gt(0).sum(dim=1).tolist()
        dev = self.device
        states = self.model(ids.to(dev), mask.to(dev)).last_hidden_state
        states = states.to(dtype=dtype or self.dtype)
        out = torch.zeros(len(texts), n, states.shape[-1], dtype=states.dtype, device=dev)
        for i, k in enumerate(lens):
            out[i, :k] = states[i, :k]
        return out


def umt5_config(raw: dict):
    from transformers import UMT5Config
    raw = {k: v for k, v in dict(raw).items() if not k.startswith("_")}
    return UMT5Config(**raw)


def random_text_encoder(config: dict, tokenizer, seed: int = 0, device="cpu",
                        dtype: torch.dtype = torch.float32) -> WanTextEncoder:
    """A UMT5 encoder of `config` (a text_encoder/config.json dict) with random weights."""
    from transformers import UMT5EncoderModel
    cfg = umt5_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        with torch.device(device):
            model = UMT5EncoderModel(cfg)
    return WanTextEncoder(model.to(dtype), tokenizer)


def load_text_encoder(path: str, device="cpu", dtype: torch.dtype = torch.float32) -> WanTextEncoder:
    """A pipeline directory's text_encoder/ and tokenizer/ (or a directory that is the encoder
    itself, with its tokenizer beside it in the same directory)."""
    from transformers import AutoTokenizer, UMT5EncoderModel
    enc_dir = os.path.join(path, "text_encoder")
    tok_dir = os.path.join(path, "tokenizer")
    if not os.path.isdir(enc_dir):
        enc_dir = tok_dir = path
    model = UMT5EncoderModel.from_pretrained(enc_dir, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    return WanTextEncoder(model, tokenizer)


__all__ = ["MAX_SEQUENCE_LENGTH", "prompt_clean", "byte_tokenizer", "WanTextEncoder", "umt5_config",
           "random_text_encoder", "load_text_encoder"]
