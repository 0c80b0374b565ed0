"""A byte-level tokenizer with Whisper's special-token layout, built locally.

The Whisper presets have random weights and no checkpoint files, so they have no
tokenizer of their own; tests need a tokenizer for tiny checkpoints written by
transformers. This one has:
    ids 0..255       one byte each (GPT-2's byte-to-unicode characters)
    ids 256..eot-1   filler tokens of two byte characters (never produced by encode:
                     there are no merges; they decode to their two bytes)
    eot..vocab-1     <|endoftext|>, <|startoftranscript|>, the language tokens, <|translate|>,
                     <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nospeech|>,
                     <|notimestamps|>, <|0.00|> ... <|30.00|>   (tokens.py layout)
so `WhisperTokens.from_tokenizer(tok, vocab_size)` accepts it and any text round-trips
through its UTF-8 bytes. `save_pretrained(dir)` writes it next to a checkpoint.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from mstar.models.tokenizer import _byte_to_char
    from mstar.models.whisper.tokens import NUM_TIMESTAMPS, WhisperTokens
    t = WhisperTokens.from_vocab_size(vocab_size)
    chars = _byte_to_char()
    vocab = {ch: i for i, ch in enumerate(chars)}
    i = 0
    while len(vocab) < t.eot:  # fillers: two-character strings
        s = chars[i // 256] + chars[i % 256]
        i += 1
        if s not in vocab:
            vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{c}|>" for c in t.languages]
    specials += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                 "<|notimestamps|>"]
    specials += [f"<|{k * 0.02:.2f}|>" for k in range(NUM_TIMESTAMPS)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    assert tok.token_to_id("<|notimestamps|>") == t.notimestamps
    return tok.to_str()


def whisper_byte_tokenizer(vocab_size: int = 51866):
    """A fresh PreTrainedTokenizerFast with the Whisper layout of `vocab_size` (51865 / 51866)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
                                  eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.model_max_length = 448
    return tok


__all__ = ["whisper_byte_tokenizer"]
