"""The offline API: the same EngineCore the server uses, driven in-process.

    from mstar import LLM, SamplingParams
    llm = LLM("tiny-qwen3.5", dtype="float32", device="cpu")
    outs = llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mstar.models.presets import DEFAULT_MODEL
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.engine_core import EngineCore
from mstar.runtime.engine.output_processor import OutputProcessor, RequestOutput
from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
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
