"""The offline API: the same engine the server uses, driven in-process (the engine of the model's
family, as the engine process picks it: EngineCore, or the stage engine for a family with a
stage pipeline; engine_process.default_engine).

    from mstar import LLM, SamplingParams
    llm = LLM("tiny-qwen3.5", dtype="float32", device="cpu")
    outs = llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason

    tts = LLM("tiny-kokoro", device="cpu")        # or a speech LM: LLM("tiny-orpheus", ...)
    (sp,) = tts.synthesize("Hello there.", voice="af_heart", seed=1)
    sp.samples, sp.sample_rate                      # float32 mono in [-1, 1], 24000
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mstar.models.presets import DEFAULT_MODEL
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.output_processor import OutputProcessor, RequestOutput
from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "Speech"]

# what LLM.synthesize passes on to a family's speech inputs (interfaces.MediaRequest.inputs); an
# inputs dict may hold these (and whatever else its family reads, e.g. Kokoro's `durations`)
SPEECH_INPUTS = ("text", "phonemes", "voice", "speed", "language", "instructions", "max_new_tokens")


@dataclass
class Speech:
    """One synthesized utterance: mono float32 samples in [-1, 1] at `sample_rate` Hz."""
    samples: np.ndarray
    sample_rate: int
    request_id: str = ""

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate if self.sample_rate else 0.0


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        from mstar.runtime.engine.engine_process import default_engine
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = default_engine(self.config)
        self.tokenizer = getattr(self.engine, "tokenizer", None)  # a stage engine has none
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's helper processes (tp > 1: the tensor-parallel followers; they
        also stop when this process exits). The LLM is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- inputs ----------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "this model has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return list(prompt)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self._encode(p) for p in prompts]
        return self._run(ids, plist, use_tqdm)

    def chat(self, messages_batch, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = False, add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the
        tokenizer's chat template."""
        if self.tokenizer is None:
            raise RequestError("messages", "this model has no tokenizer")
        if messages_batch and isinstance(messages_batch[0], dict):
            messages_batch = [messages_batch]
        prompts = []
        for msgs in messages_batch:
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs)
            prompts.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        return self._run(prompts, plist, use_tqdm)

    # --- speech recognition (TRANSCRIBES families: Whisper) -----------------------------------
    def transcribe(self, audio, language: str | None = None, task: str = "transcribe", prompt: str | None = None,
                   temperature: float = 0.0, max_tokens: int | None = None, *, min_tokens: int = 0,
                   ignore_eos: bool = False, verbose: bool = False, max_seconds: float | None = None):
        """Transcribe (or translate) one audio clip: file bytes / a binary file object
        (WAV, FLAC, OGG, MP3...) or 16 kHz mono samples. Audio longer than 30 s runs as
        consecutive 30 s windows, decoded in parallel, texts joined. Returns the text, or
        with verbose=True OpenAI's verbose_json dict (language, duration, one segment per
        window with start / end / tokens). language None: detected from the first window.
        Forced output length (benchmarks): max_tokens with ignore_eos=True (or min_tokens)."""
        from mstar.models import interfaces as I
        from mstar.runtime.engine.planned_requests import engine_request
        eng = self.engine
        fam = getattr(eng, "family", None)
        if I.TRANSCRIBES not in getattr(eng, "capabilities", ()) or fam is None or fam.transcriber is None:
            raise RequestError("model", f"{self.config.model} is not a speech-recognition model")
        if getattr(self, "_transcriber", None) is None:
            self._transcriber = fam.transcriber(eng.vocab_size, self.tokenizer)
        tr = self._transcriber
        kw = {} if max_seconds is None else {"max_seconds": max_seconds}
        plan = tr.plan(audio, language=language, task=task, prompt=prompt, temperature=temperature,
                       max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=verbose, **kw)
        base = f"asr-{next(self._ids)}"
        if plan.needs_detection:
            (ids,), _ = self._run_requests([engine_request(base + "-lang", plan.detection_request())])
            plan.set_detected(ids[0])
        outs, lps = self._run_requests([engine_request(f"{base}-{i}", p) for i, p in enumerate(plan.requests())])
        body = tr.result(plan, outs, lps if verbose else None)
        return body if verbose else body["text"]

    def _run_requests(self, reqs: list[EngineRequest]) -> tuple[list[list[int]], list[list[float]]]:
        """Run engine requests to completion: (token ids, sampled-token logprobs) per request."""
        eng = self.engine
        toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        lps: dict[str, list[float]] = {r.request_id: [] for r in reqs}
        done: set[str] = set()
        added: list[str] = []
        try:
            for r in reqs:
                eng.add_request(r)
                added.append(r.request_id)
            while len(done) < len(reqs) and eng.has_unfinished():
                for o in eng.step():
                    if o.request_id not in toks:
                        continue
                    toks[o.request_id] += o.new_token_ids
                    if o.new_logprobs:
                        lps[o.request_id] += [lp.logprob for lp in o.new_logprobs]
                    if o.finished:
                        done.add(o.request_id)
        except BaseException:
            eng.abort([r for r in added if r not in done])
            while eng.has_unfinished() and not eng.num_unfinished():
                eng.step()
            raise
        return [toks[r.request_id] for r in reqs], [lps[r.request_id] for r in reqs]

    # --- speech synthesis (SYNTHESIZES_SPEECH families: Kokoro, Orpheus) ----------------------
    def synthesize(self, texts_or_inputs=None, voice: str | None = None, *, speed: float = 1.0,
                   seed: int | Sequence[int] = 0, max_new_tokens: int | None = None,
                   phonemes: str | Sequence[str] | None = None, language: str | None = None) -> list[Speech]:
        """Speak each text (or inputs dict); one Speech per item, in order. Every request is
        submitted first, then the engine steps until all are done (they batch as on the server).

        texts_or_inputs  a text, an inputs dict ({"input" | "text", "phonemes", "voice", "speed",
                         "language", "instructions", "max_new_tokens", "seed", ...: the family's
                         MediaRequest inputs; the keyword arguments fill the keys a dict leaves
                         out}), or a list of them; None: `phonemes` alone
        phonemes         a phoneme string per item (Kokoro: used instead of the text), or one for all
        seed             one for every request, or one per item (a request's audio is a function
                         of its inputs and seed, batched or not)
        A request the model cannot take raises RequestError (a ValueError) naming the field; a
        model that fails on one raises RuntimeError."""
        from mstar.models import interfaces as I
        reqs = self.speech_requests(texts_or_inputs, voice, speed=speed, seed=seed, max_new_tokens=max_new_tokens,
                                    phonemes=phonemes, language=language)
        accepts = getattr(self.engine, "accepts", None) or {}
        outs = self._run_media(reqs)
        speeches = []
        for i, r in enumerate(reqs):
            final, chunks = outs[r.request_id]
            if final.finish_reason == "error":
                raise RuntimeError(f"the model failed on item {i}: {final.error}")
            if final.finish_reason == "abort":
                raise RuntimeError(f"the engine aborted item {i}")
            audio = [c for c in chunks if isinstance(c, I.AudioChunk)]
            rates = {int(c.sample_rate) for c in audio}
            if len(rates) > 1:
                raise RuntimeError(f"item {i}: the model's audio changed sample rate ({sorted(rates)})")
            rate = rates.pop() if rates else int(accepts.get("sample_rate") or 0)
            pcm = (np.concatenate([np.asarray(c.pcm, dtype=np.float32).reshape(-1) for c in audio]) if audio
                   else np.zeros(0, dtype=np.float32))
            speeches.append(Speech(pcm, rate, r.request_id))
        return speeches

    def speech_requests(self, texts_or_inputs=None, voice: str | None = None, *, speed: float = 1.0,
                        seed: int | Sequence[int] = 0, max_new_tokens: int | None = None,
                        phonemes: str | Sequence[str] | None = None, language: str | None = None) -> list:
        """The engine requests synthesize() runs (arguments as there), checked as the server checks
        them: for callers that drive `self.engine` themselves (mstar.bench.speech)."""
        from mstar.models import interfaces as I
        eng = self.engine
        if I.SYNTHESIZES_SPEECH not in (getattr(eng, "capabilities", None) or ()):
            raise RequestError("model", f"{self.config.model} does not synthesize speech")
        items = self._speech_items(texts_or_inputs, phonemes)
        seeds = [seed] * len(items) if isinstance(seed, int) else list(seed)
        if len(seeds) != len(items):
            raise RequestError("seed", f"{len(seeds)} seeds for {len(items)} requests")
        defaults = {"voice": voice, "speed": speed, "max_new_tokens": max_new_tokens, "language": language}
        accepts = getattr(eng, "accepts", None) or {}
        reqs = []
        base = f"tts-{next(self._ids)}"
        for i, (item, s) in enumerate(zip(items, seeds)):
            inputs = dict(item)
            if "seed" in inputs:
                s = inputs.pop("seed")
            for k, v in defaults.items():
                if v is not None and inputs.get(k) is None:
                    inputs[k] = v
            if inputs.get("voice") is None and accepts.get("voices"):  # as the server: the first voice
                inputs["voice"] = str(accepts["voices"][0])
            try:
                self._check_speech(inputs, s, accepts)
            except RequestError as e:
                raise RequestError(e.field, e.message if len(items) == 1 else f"item {i}: {e.message}") from None
            rid = f"{base}-{i}"
            reqs.append(EngineRequest(rid, [], SamplingParams(max_tokens=1),
                                      media=I.MediaRequest(rid, inputs, int(s) % (1 << 63))))
        return reqs

    @staticmethod
    def _speech_items(texts_or_inputs, phonemes) -> list[dict]:
        src = texts_or_inputs
        if src is None:
            if phonemes is None:
                raise RequestError("input", "give texts (or inputs dicts) or phonemes")
            ps = [phonemes] if isinstance(phonemes, str) else list(phonemes)
            return [{"phonemes": p} for p in ps]
        one = isinstance(src, (str, dict))
        src = [src] if one else list(src)
        items = []
        for i, t in enumerate(src):
            if isinstance(t, str):
                items.append({"text": t})
            elif isinstance(t, dict):
                d = dict(t)
                if "input" in d:  # the route's name of the text
                    if "text" in d:
                        raise RequestError("input", f"item {i}: give `input` or `text`, not both")
                    d["text"] = d.pop("input")
                items.append(d)
            else:
                raise RequestError("input", f"item {i}: a text or an inputs dict, got {type(t).__name__}")
        if phonemes is not None:
            ps = [phonemes] * len(items) if isinstance(phonemes, str) else list(phonemes)
            if len(ps) != len(items):
                raise RequestError("phonemes", f"{len(ps)} phoneme strings for {len(items)} requests")
            for d, p in zip(items, ps):
                d.setdefault("phonemes", p)
        return items

    @staticmethod
    def _check_speech(inputs: dict, seed, accepts: dict) -> None:
        """The checks the server's route makes before a request reaches the engine."""
        text, ps = inputs.get("text"), inputs.get("phonemes")
        if ps is not None and (not isinstance(ps, str) or not ps.strip()):
            raise RequestError("phonemes", "must be a non-empty string")
        if text is None and ps is None:
            raise RequestError("input", "no text (or phonemes)")
        if text is not None:
            if not isinstance(text, str):
                raise RequestError("input", f"must be a string, got {type(text).__name__}")
            if ps is None and not text.strip():
                raise RequestError("input", "the text is empty")
            limit = accepts.get("max_input_chars")
            if isinstance(limit, int) and len(text) > limit:
                raise RequestError("input", f"{len(text)} characters; at most {limit}")
        voices = [str(v) for v in accepts.get("voices") or ()]
        v = inputs.get("voice")
        if v is not None and voices and v not in voices:
            raise RequestError("voice", f"{v!r} is not a voice of this model; use one of {', '.join(voices)}")
        sp = inputs.get("speed")
        if sp is not None:
            if isinstance(sp, bool) or not isinstance(sp, (int, float)) or not math.isfinite(sp) or sp <= 0:
                raise RequestError("speed", f"must be a positive number, got {sp!r}")
            speeds = accepts.get("speeds")
            if speeds and float(sp) not in [float(x) for x in speeds]:
                raise RequestError("speed", f"this model speaks at {', '.join(f'{float(x):g}' for x in speeds)} "
                                            f"only, got {sp:g}")
        n = inputs.get("max_new_tokens")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise RequestError("max_new_tokens", f"must be a positive integer, got {n!r}")
        lang = inputs.get("language")
        if lang is not None and not isinstance(lang, str):
            raise RequestError("language", f"must be a string, got {type(lang).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RequestError("seed", f"must be an integer, got {seed!r}")

    def _run_media(self, reqs: list[EngineRequest]) -> dict[str, tuple]:
        """Run media requests to completion: {request id: (final CoreOutput, every typed output)}."""
        eng = self.engine
        media: dict[str, list] = {r.request_id: [] for r in reqs}
        final: dict[str, object] = {}
        added: list[str] = []
        try:
            for r in reqs:
                eng.add_request(r)
                added.append(r.request_id)
            while len(final) < len(reqs) and eng.has_unfinished():
                for o in eng.step():
                    if o.request_id not in media:
                        continue
                    media[o.request_id].extend(o.media or ())
                    if o.finished:
                        final[o.request_id] = o
        except BaseException:
            eng.abort([r for r in added if r not in final])
            while eng.has_unfinished() and not eng.num_unfinished():
                eng.step()
            raise
        missing = [r.request_id for r in reqs if r.request_id not in final]
        if missing:
            raise RuntimeError(f"the engine stopped with {len(missing)} request(s) unfinished")
        return {rid: (final[rid], media[rid]) for rid in media}

    # --- the loop --------------------------------------------------------------------------
    def _run(self, ids: list[list[int]], plist: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        eng, proc = self.engine, self.processor
        rids: list[str] = []
        try:
            for p_ids, p in zip(ids, plist):
                if p.n != 1:
                    raise RequestError("n", "the offline API returns one sequence per prompt (n=1)")
                rid = f"llm-{next(self._ids)}"
                eng.add_request(EngineRequest(rid, p_ids, p))
                proc.add_request(rid, p_ids, p)
                rids.append(rid)
        except Exception:
            eng.abort(rids)
            for r in rids:
                proc.abort(r)
            eng.step()  # drain the abort outputs
            raise
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(rids), desc="generate")
        try:
            while len(final) < len(rids) and eng.has_unfinished():
                outs, stop_hits = proc.process(eng.step())
                if stop_hits:
                    eng.abort(stop_hits)
                for o in outs:
                    if o.finished:
                        final[o.request_id] = o
                        if bar is not None:
                            bar.update(1)
            # abort outputs of requests finished by a stop string: flush them
            while eng.has_unfinished() and not eng.num_unfinished():
                eng.step()
        except BaseException:
            left = [r for r in rids if r not in final]
            eng.abort(left)
            for r in left:
                proc.abort(r)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in rids]
