"""Cosmos3's prompt: there is no text encoder, the prompt's tokens are the understanding tower's
input. Their ids are made as diffusers' Cosmos3OmniPipeline.tokenize_prompt makes them (0.42,
text-to-image and text-to-video):

    1. metadata sentences appended to the text (and their negations to the negative prompt, ""
       when none is given), each after the text with its final periods stripped and ". ":
         video (num_frames > 1)  "The video is {num_frames / fps:.1f} seconds long and is of {fps:.0f} FPS."
                                 (negative: "The video is not ... long and is not of ... FPS.")
         always                  "This image is of {height}x{width} resolution." (a video: "This video
                                 is of ..."; negative: "... is not of ...")
    2. the tokenizer's chat template over [system prompt (when the checkpoint's
       default_use_system_prompt says so: one for images, one for videos), the user's text],
       with the generation prompt; then the tokenizer's eos and <|vision_start|> appended.

A pipeline directory holds the tokenizer in text_tokenizer/ (AutoTokenizer, with its chat
template). `byte_tokenizer()` is an offline stand-in for the presets (mstar's byte-level ChatML
tokenizer plus <|vision_start|> and <|vision_end|>).
"""

from __future__ import annotations

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."


def _append(text: str, sentence: str) -> str:
    text = text.rstrip(".")
    return f"{text}. {sentence}" if text else sentence


def with_metadata(text: str, *, num_frames: int, height: int, width: int, fps: float, negative: bool) -> str:
    """The text with the resolution (and, for a video, duration) sentence, negated for a negative prompt."""
    not_ = "not " if negative else ""
    if num_frames != 1:
        text = _append(text, f"The video is {not_}{num_frames / fps:.1f} seconds long and is {not_}of {fps:.0f} FPS.")
    kind = "image" if num_frames == 1 else "video"
    return _append(text, f"This {kind} is {not_}of {height}x{width} resolution.")


class Cosmos3Prompter:
    """Prompts -> token ids of the understanding tower (module docstring)."""

    def __init__(self, tokenizer, use_system_prompt: bool):
        self.tokenizer = tokenizer
        self.use_system_prompt = bool(use_system_prompt)
        self.eos_id = tokenizer.eos_token_id
        self.vision_start_id = tokenizer.convert_tokens_to_ids(VISION_START)
        unk = getattr(tokenizer, "unk_token_id", None)
        if self.eos_id is None or self.vision_start_id is None or self.vision_start_id == unk:
            raise ValueError(f"cosmos3: the tokenizer needs an eos token and {VISION_START}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("cosmos3: the tokenizer has no chat template")

    def ids(self, text: str, num_frames: int) -> list[int]:
        """The token ids of one (already templated) text."""
        chat = []
        if self.use_system_prompt:
            chat.append({"role": "system", "content": SYSTEM_PROMPT_IMAGE if num_frames == 1 else SYSTEM_PROMPT_VIDEO})
        chat.append({"role": "user", "content": text})
        enc = self.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, add_vision_id=False,
                                                 return_dict=True)
        return [int(i) for i in enc["input_ids"]] + [int(self.eos_id), int(self.vision_start_id)]

    def prompt_ids(self, prompt: str, negative_prompt: str | None, *, num_frames: int, height: int, width: int,
                   fps: float) -> tuple[list[int], list[int]]:
        """(cond ids, uncond ids) of a request."""
        meta = dict(num_frames=num_frames, height=height, width=width, fps=fps)
        cond = with_metadata(prompt, negative=False, **meta)
        uncond = with_metadata(negative_prompt or "", negative=True, **meta)
        return self.ids(cond, num_frames), self.ids(uncond, num_frames)


def byte_tokenizer():
    """An offline byte-level ChatML tokenizer with <|vision_start|> / <|vision_end|> (a fresh one per call)."""
    from tokenizers import AddedToken

    from mstar.models.tokenizer import byte_tokenizer as chatml_bytes
    tok = chatml_bytes()
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in (VISION_START, VISION_END)],
                   special_tokens=True)
    return tok


BYTE_VOCAB = 261  # the byte tokenizer's: 256 bytes, 3 ChatML specials, the two vision markers

__all__ = ["VISION_START", "VISION_END", "SYSTEM_PROMPT_IMAGE", "SYSTEM_PROMPT_VIDEO", "with_metadata",
           "Cosmos3Prompter", "byte_tokenizer", "BYTE_VOCAB"]
