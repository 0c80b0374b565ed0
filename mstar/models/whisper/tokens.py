"""Whisper's special tokens and decoder prompts (no timestamps by default).

The decoder of a Whisper request starts from a forced prompt:

    [<|startofprev|>, *previous-text ids]         (optional: the `prompt` of the API)
    <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>   (multilingual models)
    <|startoftranscript|> <|notimestamps|>                     (English-only models)

and the model continues with text tokens until <|endoftext|>. Token ids follow one layout
(OpenAI's tokenizer): after <|endoftext|> come <|startoftranscript|>, the language tokens
in `LANGUAGES` order, then translate, transcribe, startoflm, startofprev, nospeech,
notimestamps and 1501 timestamp tokens, so the vocabulary size gives every id:
    multilingual v1/v2: 51865 (99 languages)   v3: 51866 (100, + yue)   English-only: 51864
A tokenizer, when there is one, is checked against this layout (`from_tokenizer`).

Suppression (generation_config.json of the checkpoints): `suppress_tokens` are masked at
every step, `begin_suppress_tokens` (space and <|endoftext|>) at the first generated
token only; `apply_suppression` does both on a batch of logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TARGET_POSITIONS = 448
NUM_TIMESTAMPS = 1501
TASKS = ("transcribe", "translate")


def _languages() -> tuple[list[str], dict[str, str]]:
    """(language codes in token order, {lowercase name or alias: code}) from transformers'
    Whisper tokenizer tables (the order of the language tokens in the vocabulary)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE
    return list(LANGUAGES), {k.lower(): v for k, v in TO_LANGUAGE_CODE.items()}


class WhisperPromptError(ValueError):
    """A bad language / task / prompt for a Whisper request (maps to HTTP 400)."""


@dataclass(frozen=True)
class WhisperTokens:
    eot: int
    sot: int
    languages: dict[str, int]  # code ("en") -> token id
    translate: int
    transcribe: int
    startoflm: int
    startofprev: int
    nospeech: int
    notimestamps: int
    timestamp_begin: int
    multilingual: bool
    vocab_size: int
    names: dict[str, str] = field(default_factory=dict, compare=False)  # name/alias -> code

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_vocab_size(cls, vocab_size: int) -> "WhisperTokens":
        """The id layout of a Whisper vocabulary: 51864 (English-only), 51865 (v1/v2), 51866 (v3)."""
        codes, names = _languages()
        multilingual = vocab_size >= 51865
        eot = 50257 if multilingual else 50256
        sot = eot + 1
        n_lang = vocab_size - (sot + 1 + 6 + NUM_TIMESTAMPS)
        if not 0 < n_lang <= len(codes):
            raise ValueError(f"vocab size {vocab_size} does not fit the Whisper token layout")
        base = sot + 1 + n_lang
        return cls(eot=eot, sot=sot, languages={c: sot + 1 + i for i, c in enumerate(codes[:n_lang])},
                   translate=base, transcribe=base + 1, startoflm=base + 2, startofprev=base + 3,
                   nospeech=base + 4, notimestamps=base + 5, timestamp_begin=base + 6,
                   multilingual=multilingual, vocab_size=vocab_size, names=names)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> "WhisperTokens":
        """The layout of `vocab_size` (default: the tokenizer's length), checked against the
        tokenizer's own ids for the special tokens."""
        n = int(vocab_size if vocab_size is not None else len(tokenizer))
        t = cls.from_vocab_size(n)
        want = {"<|endoftext|>": t.eot, "<|startoftranscript|>": t.sot, "<|translate|>": t.translate,
                "<|transcribe|>": t.transcribe, "<|startofprev|>": t.startofprev,
                "<|notimestamps|>": t.notimestamps}
        got = {k: tokenizer.convert_tokens_to_ids(k) for k in want}
        bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        if bad:
            raise ValueError(f"tokenizer special tokens do not follow the Whisper layout of vocab {n}: "
                             f"{bad} (token: (tokenizer id, expected id))")
        return t

    # --- prompts ------------------------------------------------------------------------------
    def language_id(self, language: str) -> int:
        """'en', 'English', '<|en|>' (any case) -> the language token id."""
        if not isinstance(language, str) or not language.strip():
            raise WhisperPromptError("language must be a non-empty string such as 'en'")
        key = language.strip().lower()
        if key.startswith("<|") and key.endswith("|>"):
            key = key[2:-2]
        code = key if key in self.languages else self.names.get(key)
        if code is None or code not in self.languages:
            raise WhisperPromptError(f"unsupported language {language!r}: use an ISO 639-1 code such as "
                                     f"'en', 'de', 'zh' ({len(self.languages)} supported)")
        return self.languages[code]

    def task_id(self, task: str) -> int:
        if task not in TASKS:
            raise WhisperPromptError(f"task must be one of {TASKS}, got {task!r}")
        return self.transcribe if task == "transcribe" else self.translate

    def decoder_prompt(self, language: str | None = "en", task: str = "transcribe", timestamps: bool = False,
                       prev_ids: list[int] | None = None) -> list[int]:
        """The forced decoder prompt. prev_ids: the text ids of a previous-text prompt
        (without <|startofprev|>); its last 223 ids are kept, as OpenAI's decoder does.
        language None on a multilingual model: the prompt stops after <|startoftranscript|>
        (detect the language from the next logits: `language_from_logits`, then continue
        with `task_suffix`)."""
        out: list[int] = []
        if prev_ids:
            keep = MAX_TARGET_POSITIONS // 2 - 1
            prev = [int(i) for i in prev_ids]
            if any(i < 0 or i >= self.eot for i in prev):
                raise WhisperPromptError("prompt token ids must be text tokens (below <|endoftext|>)")
            out = [self.startofprev] + prev[-keep:]
        out.append(self.sot)
        if not self.multilingual:
            if task != "transcribe":
                raise WhisperPromptError("an English-only Whisper model can only transcribe")
            if not timestamps:
                out.append(self.notimestamps)
            return out
        if language is None:
            return out
        out.append(self.language_id(language))
        out += self.task_suffix(task, timestamps)
        return out

    def task_suffix(self, task: str = "transcribe", timestamps: bool = False) -> list[int]:
        """What follows the language token: <|task|> [<|notimestamps|>]."""
        return [self.task_id(task)] + ([] if timestamps else [self.notimestamps])

    def language_from_logits(self, logits: torch.Tensor) -> list[str]:
        """Language detection: logits [N, vocab] at the position after <|startoftranscript|>
        -> the most likely language code per row."""
        codes = list(self.languages)
        ids = torch.tensor([self.languages[c] for c in codes], device=logits.device)
        best = logits.index_select(-1, ids).argmax(-1).tolist()
        return [codes[i] for i in best]

    def max_new_tokens(self, prompt_len: int, requested: int | None = None) -> int:
        """How many tokens may follow a prompt of prompt_len (positions < 448)."""
        room = MAX_TARGET_POSITIONS - prompt_len
        if room <= 0:
            raise WhisperPromptError(f"decoder prompt of {prompt_len} tokens leaves no room "
                                     f"(Whisper decodes at most {MAX_TARGET_POSITIONS} positions)")
        return room if requested is None else max(0, min(int(requested), room))

    def timestamp_ids(self) -> list[int]:
        """The 1501 timestamp tokens: add them to the suppressed tokens when decoding without
        timestamps (trained checkpoints do not emit them after <|notimestamps|>; random
        weights do, and transformers then splits its output into segments)."""
        return list(range(self.timestamp_begin, self.vocab_size))

    def text_ids(self, ids: list[int]) -> list[int]:
        """The text tokens of a generated sequence: stops at <|endoftext|>, drops other
        special and timestamp tokens."""
        out = []
        for i in ids:
            if i == self.eot:
                break
            if i < self.eot:
                out.append(int(i))
        return out

    def decode_text(self, tokenizer, ids: list[int]) -> str:
        return tokenizer.decode(self.text_ids(ids), skip_special_tokens=True).strip()


# --- suppression -------------------------------------------------------------------------------
def suppress_lists(generation_config) -> tuple[list[int], list[int]]:
    """(suppress_tokens, begin_suppress_tokens) of a transformers GenerationConfig (or dict)."""
    get = generation_config.get if isinstance(generation_config, dict) else \
        (lambda k, d=None: getattr(generation_config, k, d))
    return list(get("suppress_tokens", None) or []), list(get("begin_suppress_tokens", None) or [])


def apply_suppression(logits: torch.Tensor, suppress: list[int] | torch.Tensor | None = None,
                      begin_suppress: list[int] | torch.Tensor | None = None,
                      first_step: torch.Tensor | list[bool] | None = None) -> torch.Tensor:
    """In place on logits [N, vocab]: -inf at `suppress` in every row, and at
    `begin_suppress` in the rows whose token is the first generated one (first_step [N] bool)."""
    neg = float("-inf")
    if suppress is not None and len(suppress):
        idx = torch.as_tensor(suppress, device=logits.device, dtype=torch.long)
        logits.index_fill_(-1, idx, neg)
    if begin_suppress is not None and len(begin_suppress) and first_step is not None:
        rows = torch.as_tensor(first_step, device=logits.device, dtype=torch.bool)
        if bool(rows.any()):
            idx = torch.as_tensor(begin_suppress, device=logits.device, dtype=torch.long)
            sub = logits[rows]
            sub.index_fill_(-1, idx, neg)
            logits[rows] = sub
    return logits


__all__ = ["WhisperTokens", "WhisperPromptError", "apply_suppression", "suppress_lists", "MAX_TARGET_POSITIONS",
           "TASKS"]
