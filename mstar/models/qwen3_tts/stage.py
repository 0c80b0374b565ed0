"""Qwen3-TTS served as one decode-loop stage (interfaces.DecodeLoopStage) of the stage engine.

One engine step is one frame of every running request: the talker's decode and the code
predictor's 15 codebooks for all rows (generate.TalkerGenerator), then one batched codec call for
every stream with a chunk ready (codec_streaming.CodecStreamer). Requests join the running batch
before any step and leave when their last chunk is out, so first audio comes after the prompt's
prefill and `initial_codec_chunk_frames` frames, whatever else is running.

Request inputs (the speech route's fields, checked by `prepare`; a wrong one is a ValueError
"field: message", which the engine answers as a 400 naming the field):
    text                    what to say (the route's `input`)
    voice                   a CustomVoice speaker (default: the route's first voice); a VoiceDesign
                            model takes none
    instructions            a style instruction (CustomVoice 1.7B) or the voice description
                            (VoiceDesign: required); the 0.6B CustomVoice model ignores it, as
                            the release does
    language                a language of the model's table or "auto" (default)
    task_type               CustomVoice | VoiceDesign | Base: must be the checkpoint's own task;
                            Base (voice cloning) is not built
    ref_audio, ref_text     voice cloning's reference: not built (a 400)
    non_streaming_mode      true (the release's default): the whole text in the prompt; false: the
                            talker reads the text one token per frame
    max_new_tokens          most frames (80 ms each); default min(generation_config's, the row's
                            budget left by the prompt)
    min_new_tokens          frames before end of speech may be drawn (offline API: benchmarks pin
                            a request's length with min = max)
    initial_codec_chunk_frames  frames in the first audio chunk (default the stage's)
    speed                   1 only
A request's prompt and frames together hold at most `max_row_tokens` talker positions (its K/V
pages are reserved for that many).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar import knobs
from mstar.models import interfaces as I
from mstar.models.qwen3_tts.codec import Qwen3TTSCodecDecoder
from mstar.models.qwen3_tts.codec_streaming import CodecStreamer
from mstar.models.qwen3_tts.config import Qwen3TTSConfig
from mstar.models.qwen3_tts.generate import GenerationParams, GenerationState, TalkerGenerator
from mstar.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest, TalkerPrompt
from mstar.models.qwen3_tts.talker import Talker

TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
ROUTE_FIELDS = ("task_type", "ref_audio", "ref_text", "initial_codec_chunk_frames", "non_streaming_mode")
MAX_INPUT_CHARS = 2048
MAX_INITIAL_CHUNK_FRAMES = 64
DEFAULT_MAX_FRAMES = 2048  # vLLM-Omni's default max_new_tokens for Qwen3-TTS: 164 s of audio


@dataclass
class _Batch:
    """The stage's state of one running batch: the generator's rows (request ids in order), the
    rows that ended at their first frame (reported by the next step), and the last outputs of
    done rows, handed back by leave."""
    gen: GenerationState
    rids: list[str]
    ended_early: set[str] = field(default_factory=set)
    last: dict[str, list] = field(default_factory=dict)


class Qwen3TTSSynthesis:
    """A loaded model (config, talker, codec decoder, tokenizer) as a stage pipeline.

    max_batch: the most requests stepped at once (the generator's rows, the codec's streams);
    max_row_tokens: talker positions a request may use (prompt + frames), its K/V reserved;
    initial_chunk_frames / chunk_frames: the codec's first and later chunk sizes."""

    def __init__(self, config: Qwen3TTSConfig, talker: Talker, codec: Qwen3TTSCodecDecoder, tokenizer, *,
                 generation_config: dict | None = None, max_batch: int = 32, max_row_tokens: int = 4096,
                 initial_chunk_frames: int = 4, chunk_frames: int = 8, page_size: int = 16,
                 max_input_chars: int = MAX_INPUT_CHARS):
        if config.tts_model_type == "base":
            raise ValueError("qwen3-tts: this is a Base model (voice cloning from reference audio), which mstar does "
                             "not build; serve a CustomVoice or VoiceDesign checkpoint")
        self.config = config
        self.max_batch = int(max_batch)
        self.max_row_tokens = int(max_row_tokens)
        self.max_input_chars = int(max_input_chars)
        pages_per_row = -(-self.max_row_tokens // page_size)
        graphs = "auto" if knobs.value("MSTAR_TTS_FRAME_GRAPHS") else "off"
        self.generator = TalkerGenerator(talker, config, max_rows=self.max_batch,
                                         num_pages=self.max_batch * pages_per_row, page_size=page_size,
                                         graphs=graphs)
        self.streamer = CodecStreamer(codec, initial_chunk_frames, chunk_frames, capacity=self.max_batch,
                                      graphs="auto" if knobs.value("MSTAR_TTS_CODEC_GRAPHS") else "off")
        self.sample_rate = int(codec.config.output_sample_rate)
        self.builder = PromptBuilder(config, tokenizer)
        gc = dict(generation_config or {})
        self.max_frames = int(min(gc.get("max_new_tokens", DEFAULT_MAX_FRAMES), DEFAULT_MAX_FRAMES))
        self.defaults = GenerationParams.from_generation_config(gc, max_new_tokens=self.max_frames)
        self.task = config.tts_model_type or "custom_voice"
        voices = self.builder.speakers() if self.task == "custom_voice" else []
        accepts = {"voices": voices, "max_input_chars": self.max_input_chars, "speeds": [1.0],
                   "languages": list(config.talker.languages), "sample_rate": self.sample_rate,
                   "fields": list(ROUTE_FIELDS)}
        stage = I.DecodeLoopStage(start=self.start, step=self.step, join=self.join, leave=self.leave,
                                  batch_key=self.batch_key, max_batch=self.max_batch)
        self.pipeline = I.Pipeline([stage], accepts=accepts)

    # --- a request's inputs -------------------------------------------------------------------
    def prepare(self, req: I.MediaRequest) -> tuple[TalkerPrompt, GenerationParams, int | None]:
        """(the talker prompt, the sampling, the first chunk's frames) of a request; ValueError
        "field: message" for inputs the model cannot take."""
        inp = req.inputs
        for name in ("ref_audio", "ref_text"):
            if inp.get(name) is not None:
                raise ValueError(f"{name}: voice cloning from reference audio (the Base models' speaker encoder) "
                                 "is not built in mstar")
        task = inp.get("task_type")
        if task is not None:
            if task not in TASK_TYPES:
                raise ValueError(f"task_type: {task!r} is not one of {', '.join(TASK_TYPES)}")
            if TASK_TYPES[task] != self.task:
                mine = next(k for k, v in TASK_TYPES.items() if v == self.task)
                raise ValueError(f"task_type: this model is a {mine} model, not {task}")
        text = inp.get("text", inp.get("input"))
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text: give the text to speak")
        if len(text) > self.max_input_chars:
            raise ValueError(f"text: {len(text)} characters; at most {self.max_input_chars}")
        speed = inp.get("speed", 1.0)
        if float(speed) != 1.0:
            raise ValueError(f"speed: this model speaks at speed 1 only, got {speed}")
        voice, instruct = inp.get("voice"), inp.get("instructions")
        if self.task == "voice_design":
            if voice is not None:
                raise ValueError("voice: a VoiceDesign model has no speakers; describe the voice in `instructions`")
            if not instruct:
                raise ValueError("instructions: a VoiceDesign model needs the voice's description")
        elif voice is None:
            raise ValueError(f"voice: give a speaker ({', '.join(self.builder.speakers())})")
        elif str(voice).lower() not in self.config.talker.spk_id:
            raise ValueError(f"voice: {voice!r} is not one of {', '.join(self.builder.speakers())}")
        non_streaming = inp.get("non_streaming_mode", True)
        language = inp.get("language") or "auto"
        try:
            self.builder.language_id(language, voice)
        except ValueError:
            raise ValueError(f"language: {language!r} is not one of {', '.join(self.config.talker.languages)}") from None
        prompt = self.builder.build(SpeechRequest(text, voice, language, instruct or None, bool(non_streaming)))
        budget = self.max_row_tokens - len(prompt)
        if budget < 1:
            raise ValueError(f"text: the prompt is {len(prompt)} tokens; this server holds {self.max_row_tokens} "
                             "a request (prompt and frames)")
        max_new = inp.get("max_new_tokens")
        if max_new is None:
            max_new = min(self.max_frames, budget)
        elif not 1 <= int(max_new) <= budget:
            raise ValueError(f"max_new_tokens: at most {budget} frames for this prompt ({len(prompt)} tokens of "
                             f"{self.max_row_tokens} a request), got {max_new}")
        min_new = int(inp.get("min_new_tokens", self.defaults.min_new_tokens))
        if not 0 <= min_new <= int(max_new):
            raise ValueError(f"min_new_tokens: must be in [0, max_new_tokens = {max_new}], got {min_new}")
        first = inp.get("initial_codec_chunk_frames")
        if first is not None and not 1 <= int(first) <= MAX_INITIAL_CHUNK_FRAMES:
            raise ValueError(f"initial_codec_chunk_frames: must be in [1, {MAX_INITIAL_CHUNK_FRAMES}], got {first}")
        params = dataclasses.replace(self.defaults, max_new_tokens=int(max_new), min_new_tokens=min_new,
                                     seed=int(req.seed))
        return prompt, params, None if first is None else int(first)

    def batch_key(self, req: I.MediaRequest) -> Any:
        self.prepare(req)  # refuses bad inputs at admission
        return None  # one running batch: every request joins it

    # --- the stage ----------------------------------------------------------------------------
    def start(self, reqs: list[I.MediaRequest]) -> _Batch:
        prepared = [self.prepare(r) for r in reqs]
        rids = [r.request_id for r in reqs]
        gen, frame = self.generator.start([p for p, _, _ in prepared], [q for _, q, _ in prepared], rids)
        batch = _Batch(gen, list(rids))
        self._streams_join(batch, rids, [f for _, _, f in prepared])
        self._feed(batch, frame)
        return batch

    def join(self, batch: _Batch, reqs: list[I.MediaRequest]) -> _Batch:
        prepared = [self.prepare(r) for r in reqs]
        rids = [r.request_id for r in reqs]
        frame = self.generator.join(batch.gen, [p for p, _, _ in prepared], [q for _, q, _ in prepared], rids)
        batch.rids += rids
        self._streams_join(batch, rids, [f for _, _, f in prepared])
        self._feed(batch, frame)
        return batch

    def step(self, batch: _Batch) -> tuple[_Batch, list[tuple[list, bool]]]:
        try:
            return batch, self._step(batch)
        except BaseException:
            self._release(batch)  # the engine fails the batch's requests; nothing stays held
            raise

    def _step(self, batch: _Batch) -> list[tuple[list, bool]]:
        if not batch.ended_early:  # (a row that ended at its first frame leaves before the generator steps)
            self._feed(batch, self.generator.step(batch.gen))
        batch.ended_early.clear()  # every ended row's last chunk comes out of this codec step
        chunks = self.streamer.step()
        outs: dict[str, list] = {}
        if chunks:
            audio = torch.cat([c.audio.reshape(-1) for c in chunks]).float().cpu().numpy()  # one copy for all
            at = 0
            for c in chunks:
                n = c.audio.numel()
                if n or c.last:
                    outs.setdefault(c.stream, []).append(I.AudioChunk(audio[at:at + n], self.sample_rate,
                                                                      final=c.last))
                at += n
                if c.last:
                    batch.last[c.stream] = outs.pop(c.stream, [])
        return [(outs.get(rid, []), rid in batch.last) for rid in batch.rids]

    def leave(self, batch: _Batch, rows: list[int]) -> tuple[_Batch, list[list]]:
        gone = [batch.rids[j] for j in rows]
        self.generator.leave(batch.gen, rows)
        out = []
        for rid in gone:
            if rid in batch.last:
                out.append(batch.last.pop(rid))
            else:  # aborted: its stream is dropped with its undecoded frames
                self.streamer.leave(rid)
                out.append([])
            batch.ended_early.discard(rid)
        batch.rids = [r for j, r in enumerate(batch.rids) if j not in set(rows)]
        return batch, out

    # --- internals ----------------------------------------------------------------------------
    def _streams_join(self, batch: _Batch, rids: list[str], first_frames: list[int | None]) -> None:
        for rid, first in zip(rids, first_frames):
            self.streamer.join(rid, first)

    def _feed(self, batch: _Batch, frame) -> None:
        """A frame's codes to the rows' streams ([B, G] -> each row's [G]); ended rows finish (their
        last chunk comes out at the next codec step, which is this engine step's or the next's)."""
        codes = frame.codes
        for r, rid in enumerate(frame.ids):
            if not frame.is_eos[r]:  # an EOS frame carries no audio
                self.streamer.feed(rid, codes[r])
            if frame.done[r]:
                self.streamer.finish(rid)
                batch.ended_early.add(rid)

    def _release(self, batch: _Batch) -> None:
        """Every row of a failed batch: its K/V pages and codec streams freed."""
        self.generator.leave(batch.gen, list(range(len(batch.gen))))
        for rid in batch.rids:
            if rid in self.streamer.streams:
                self.streamer.leave(rid)
        batch.rids, batch.last = [], {}


__all__ = ["Qwen3TTSSynthesis", "TASK_TYPES", "ROUTE_FIELDS", "MAX_INPUT_CHARS"]
