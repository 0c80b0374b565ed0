"""Orpheus TTS's token conventions: the prompt it is given, and how the audio tokens it samples
become SNAC 24 kHz codes (facts from the canopyai/Orpheus-TTS release, orpheus_tts package:
engine_class.py, decoder.py).

Vocabulary: Llama 3's 128256 ids, then custom tokens `<custom_token_N>` = 128256 + N. N < 10 are
control tokens (ids below); N >= 10 are audio codes. The k-th audio token of a stream (k counted
over the audio tokens only) carries code id - 128266 - (k % 7) * 4096: each of a frame's 7
positions has its own range of 4096 ids.

What a stream's tokens do, as the release's decoder does it:
    a token whose code comes out negative is skipped and does not advance k: every id below
        128266 (text, the control tokens), and an audio id of another position's range that
        lies below this position's;
    any other token is the stream's next audio token (k + 1), its code possibly >= 4096;
    after every 7th audio token, from the 28th on, the last 28 audio tokens (4 frames) are one
        window to decode; a window holding a code >= 4096 makes no audio (the release returns
        nothing for it and goes on).
Two deviations from the release, both where it breaks: its `> 0` test drops code 0 (which then
misaligns every later frame); here 0 is a code. Its window check lets 4096 through to the
codebook lookup, which fails; here a window with 4096 makes no audio like any other out-of-range
code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # torch loads with the functions that need it: the family's declaration reads the constants
    import torch

CUSTOM_TOKEN_BASE = 128256  # <custom_token_0>
AUDIO_TOKEN_BASE = 128266  # <custom_token_10>: code 0 of frame position 0
CODEBOOK_SIZE = 4096
CODES_PER_FRAME = 7
WINDOW_TOKENS = 28  # 4 frames

# control tokens (Llama 3's <|eot_id|>, then custom tokens 1 .. 5)
END_OF_TEXT = 128009
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
PAD = 128263  # the finetune / pretrain configs' pad token

# The release's voices (its README, in its order of conversational realism); a finetune may
# have others, and the prompt takes any name.
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")

# Where generation stops: end of speech (the release's streaming examples; its package's own
# default stop id, 49158, is no Orpheus token and never ends a stream before max_tokens).
STOP_TOKEN_IDS = (END_OF_SPEECH,)

# The release package's sampling defaults (OrpheusModel.generate_tokens_sync).
DEFAULT_SAMPLING = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3, "max_tokens": 1200}


def prompt_text(text: str, voice: str | None = None) -> str:
    """The text the tokenizer encodes: "voice: text" (no prefix without a voice)."""
    return f"{voice}: {text}" if voice else text


def format_prompt(encode: Callable[[str], Sequence[int]], text: str, voice: str | None = None) -> list[int]:
    """Prompt ids: START_OF_HUMAN, encode(prompt_text(text, voice)), END_OF_TEXT, END_OF_HUMAN,
    START_OF_AI, START_OF_SPEECH. `encode` is the model tokenizer's text -> ids with its special
    tokens, as the release calls it (Llama 3's adds <|begin_of_text|> 128000 in front of the text,
    so it comes after START_OF_HUMAN)."""
    return [START_OF_HUMAN, *encode(prompt_text(text, voice)), END_OF_TEXT, END_OF_HUMAN, START_OF_AI,
            START_OF_SPEECH]


def token_code(token_id: int, k: int) -> int:
    """The code the token would carry as the stream's k-th audio token (negative: not audio)."""
    return token_id - AUDIO_TOKEN_BASE - (k % CODES_PER_FRAME) * CODEBOOK_SIZE


class AudioTokenStream:
    """One stream's audio tokens as they are sampled: `push(ids)` returns the windows they
    complete (each the stream's last 28 audio token ids, in order), for `window_codes`."""

    def __init__(self):
        self.count = 0  # k of the next audio token
        self._last: list[int] = []  # the last WINDOW_TOKENS audio token ids
        self._window: list[int] | None = None  # the last window push returned

    def push(self, token_ids: Sequence[int]) -> list[list[int]]:
        windows = []
        for t in token_ids:
            if token_code(int(t), self.count) < 0:
                continue
            self._last.append(int(t))
            if len(self._last) > WINDOW_TOKENS:
                del self._last[0]
            self.count += 1
            if self.count % CODES_PER_FRAME == 0 and self.count >= WINDOW_TOKENS:
                self._window = list(self._last)
                windows.append(self._window)
        return windows

    def last_window(self) -> list[int] | None:
        """The stream's last complete window (for the end-of-stream flush: the audio tokens of a
        frame left incomplete make no audio), None before the first."""
        return None if self._window is None else list(self._window)


def window_codes(token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of audio token ids [B, 28] (each starting at a frame, as AudioTokenStream gives
    them) -> (frames [B, 4, 7] of codes, valid [B]). A window with a code outside [0, 4096) is
    not valid (it makes no audio); its codes are zeroed so that a batch holding it still decodes."""
    if token_ids.dim() != 2 or token_ids.shape[1] != WINDOW_TOKENS:
        raise ValueError(f"token_ids must be [B, {WINDOW_TOKENS}], got {tuple(token_ids.shape)}")
    import torch
    offset = torch.arange(WINDOW_TOKENS, device=token_ids.device) % CODES_PER_FRAME * CODEBOOK_SIZE + AUDIO_TOKEN_BASE
    codes = token_ids.long() - offset
    ok = (codes >= 0) & (codes < CODEBOOK_SIZE)
    valid = ok.all(dim=1)
    codes = torch.where(valid[:, None], codes, torch.zeros_like(codes))
    return codes.view(-1, WINDOW_TOKENS // CODES_PER_FRAME, CODES_PER_FRAME), valid


def window_codebooks(token_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Windows of audio token ids [B, 28] -> ([codebook 0 [B, 4], 1 [B, 8], 2 [B, 16]], valid [B])."""
    from mstar.models.snac.streaming import codes_from_frames
    frames, valid = window_codes(token_ids)
    return codes_from_frames(frames), valid
