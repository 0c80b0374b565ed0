"""The release's talker prompt, as token ids: what the talker reads before its first frame.

The text goes through the chat template `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`
and the release's tokenizer; its first three tokens are the role (<|im_start|>, assistant, \\n), the
last five close the turn and open the next, the rest is the text to speak. Every prompt position
sums a text part and a codec part (Talker.prompt_embeds); a `TalkerPrompt` lists both as ids:

    instruct     (VoiceDesign, and CustomVoice 1.7B) `<|im_start|>user\\n{instruct}<|im_end|>\\n`, text only
    role         the three role tokens, text only
    control      text tts_pad ... tts_pad tts_bos over codec
                   think, think_bos, language, think_eos      (language given, or a speaker's dialect)
                   nothink, think_bos, think_eos               (language "auto")
                 then the speaker's codec id (CustomVoice), then codec_pad
    non-streaming (the release's default) the text tokens and tts_eos over codec_pad, then tts_pad
                 over codec_bos; afterwards the talker reads tts_pad at every frame
    streaming    the first text token over codec_bos; the talker reads the remaining text tokens
                 and tts_eos one per frame (`trailing_ids`), then tts_pad

Speaker and language names are case-insensitive. A Chinese or "auto" request for a dialect speaker
(spk_is_dialect names a language entry) takes that dialect's language id. The 0.6B CustomVoice
model ignores `instruct`, as the release does. Voice cloning (the Base models' x-vector and
in-context prompts from reference audio) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.models.qwen3_tts.config import Qwen3TTSConfig

NO_CODEC = -1  # a prompt position with a text part only


@dataclass(frozen=True)
class SpeechRequest:
    """What to say and how. speaker: a CustomVoice speaker (None for VoiceDesign); language: a
    language name or "auto"; instruct: a style instruction (VoiceDesign's voice description)."""
    text: str
    speaker: str | None = None
    language: str = "auto"
    instruct: str | None = None
    non_streaming: bool = True


@dataclass(frozen=True)
class TalkerPrompt:
    """A request's talker input as ids: prompt position i is text_ids[i] (text vocabulary) plus
    codec_ids[i] (codec vocabulary, NO_CODEC for none); trailing_ids are the text ids read one per
    generated frame before tts_pad takes over."""
    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    trailing_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.text_ids)


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


class PromptBuilder:
    """Requests -> TalkerPrompts for one model (its config and its text tokenizer: a callable
    returning {"input_ids": [...]}, as transformers' tokenizers do)."""

    def __init__(self, config: Qwen3TTSConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    def tokenize(self, text: str) -> list[int]:
        ids = self.tokenizer(text)["input_ids"]
        return [int(i) for i in ids]

    def speakers(self) -> list[str]:
        return list(self.config.talker.spk_id)

    def language_id(self, language: str | None, speaker: str | None) -> int | None:
        """The codec id of the request's language (None: "auto"); ValueError for an unknown one."""
        t = self.config.talker
        lang = (language or "auto").lower()
        if lang == "auto":
            lid = None
        elif lang in t.codec_language_id:
            lid = int(t.codec_language_id[lang])
        else:
            raise ValueError(f"qwen3-tts: language {language!r} is not supported ({', '.join(t.languages)})")
        if lang in ("chinese", "auto") and speaker:
            dialect = t.spk_is_dialect.get(speaker.lower(), False)
            if dialect is not False and dialect is not None:
                lid = int(t.codec_language_id[dialect])
        return lid

    def codec_prefix(self, language: str | None, speaker: str | None) -> list[int]:
        """The control part's codec ids: think tags (with the language), speaker, pad, bos."""
        t = self.config.talker
        lid = self.language_id(language, speaker)
        ids = ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if lid is None
               else [t.codec_think_id, t.codec_think_bos_id, lid, t.codec_think_eos_id])
        if speaker:
            if speaker.lower() not in t.spk_id:
                raise ValueError(f"qwen3-tts: speaker {speaker!r} is not supported "
                                 f"({', '.join(t.spk_id) or 'this model has none'})")
            ids.append(t.speaker_codec_id(speaker))
        return ids + [t.codec_pad_id, t.codec_bos_id]

    def build(self, request: SpeechRequest) -> TalkerPrompt:
        c = self.config
        if c.tts_model_type == "base":
            raise ValueError("qwen3-tts: the Base models clone a voice from reference audio, which is not implemented")
        ids = self.tokenize(assistant_text(request.text))
        codec = self.codec_prefix(request.language, request.speaker)
        text_ids, codec_ids = [], []
        instruct = request.instruct
        if c.tts_model_type == "custom_voice" and c.tts_model_size == "0b6":
            instruct = None  # the 0.6B CustomVoice model takes no instruction
        if instruct:
            inst = self.tokenize(instruct_text(instruct))
            text_ids += inst
            codec_ids += [NO_CODEC] * len(inst)
        text_ids += ids[:3]
        codec_ids += [NO_CODEC] * 3
        text_ids += [c.tts_pad_token_id] * (len(codec) - 2) + [c.tts_bos_token_id]
        codec_ids += codec[:-1]
        if request.non_streaming:
            body = ids[3:-5] + [c.tts_eos_token_id]
            text_ids += body + [c.tts_pad_token_id]
            codec_ids += [c.talker.codec_pad_id] * len(body) + [c.talker.codec_bos_id]
            trailing = []
        else:
            text_ids += ids[3:4]
            codec_ids += codec[-1:]
            trailing = ids[4:-5] + [c.tts_eos_token_id]
        return TalkerPrompt(tuple(text_ids), tuple(codec_ids), tuple(trailing))
