"""The offline API: the same EngineCore the server uses, driven in-process.

    from mstar import LLM, SamplingParams
    llm = LLM("tiny-qwen3.5", dtype="float32", device="cpu")
    outs = llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mstar.runtime.config import EngineConfig
from mstar.runtime.engine_core import EngineCore
from mstar.runtime.output_processor import OutputProcessor, RequestOutput
from mstar.runtime.request import EngineRequest, RequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]


class LLM:
    def __init__(self, model: str = "tiny-qwen3.5", **engine_options):
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

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
