"""Tokenizers: a checkpoint's own (transformers AutoTokenizer), or the built-in byte-level
tokenizer of the tiny embedded models.

The byte tokenizer has 256 byte tokens (id = byte value) and the ChatML specials
<|endoftext|> (256), <|im_start|> (257), <|im_end|> (258); any text round-trips through
its UTF-8 bytes. It is built locally with the `tokenizers` library and wrapped in
transformers' PreTrainedTokenizerFast with a ChatML chat template; eos is <|im_end|>.
"""

from __future__ import annotations

import functools
import os

from mstar.models import presets

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_to_char() -> list[str]:
    """The byte -> printable unicode char table of byte-level BPE: printable Latin-1
    bytes stand for themselves, the others for chars from U+0100 on, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


@functools.lru_cache(maxsize=1)
def _byte_tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: i for i, ch in enumerate(_byte_to_char())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    for s, want in zip(SPECIALS, (presets.TINY_ENDOFTEXT, presets.TINY_IM_START, presets.TINY_IM_END)):
        assert tok.token_to_id(s) == want, (s, tok.token_to_id(s))
    return tok.to_str()


def byte_tokenizer():
    """The tiny models' tokenizer (a fresh PreTrainedTokenizerFast each call)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_byte_tokenizer_json()),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"],
                                  chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)
    tok.model_max_length = 32768
    return tok


def load_tokenizer(name_or_dir: str):
    """A checkpoint directory's tokenizer, or the byte tokenizer of a tiny preset."""
    if os.path.isdir(name_or_dir):
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(name_or_dir)
        except Exception as e:  # noqa: BLE001 -- re-raised with the directory named
            raise ValueError(f"no usable tokenizer in {name_or_dir!r}: {e}") from e
    p = presets.get(name_or_dir)
    if p is None:
        raise ValueError(f"{name_or_dir!r} is neither a directory nor a preset ({', '.join(presets.names())})")
    from mstar.models import registry
    fam = registry.family_of_preset(p)
    tok = fam.preset_tokenizer(p) if fam.preset_tokenizer is not None else None
    if tok is None:
        raise ValueError(f"preset {p.name!r} has no built-in tokenizer: pass the checkpoint directory instead")
    return tok
