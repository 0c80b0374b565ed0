"""POST /v1/completions: prompts (text or token ids, `n` choices each) -> text, in OpenAI's
shape, with vLLM's extras (echo, return_token_ids, stop_reason, continuous usage stats)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_checks import (
    PromptBudget,
    check_model,
    check_stop_ids,
    max_tokens_for,
    prompt_ids_for,
)
from mstar.runtime.serving.api_jobs import ChoiceState, collect_job, start_job, usage
from mstar.runtime.serving.api_sse import ChunkEvents, sse_event, stream_job

if TYPE_CHECKING:
    from mstar.runtime.serving.api_engine import Server


async def completions(server: Server, request: Request, body: dict) -> Response:
    """POST /v1/completions (non-streamed: a JSON body; streamed: SSE chunks)."""
    req = P.parse_completion(body)
    model = check_model(server.settings, req.model)
    server.admission.check_size(len(req.prompts) * req.n, "prompt" if len(req.prompts) > 1 else "n")
    budget = PromptBudget(server, req.prompts, "prompt")
    prompts, texts = [], []
    for p in req.prompts:
        ids = await prompt_ids_for(server, p, req.add_special_tokens, "prompt")
        budget.take(len(ids))
        prompts.append(ids)
        texts.append(p if isinstance(p, str) else None)
    check_stop_ids(server, req.sampling)
    params = []
    for ids in prompts:
        mt = max_tokens_for(server, len(ids), req, "prompt")
        params.append(P.build_params(req.sampling, mt, max_tokens_field=req.max_tokens_field,
                                     logprobs=req.logprobs))
    echoed = [None] * len(prompts)
    if req.echo and server.tokenizer is not None:  # token-id prompts echoed as text, decoded off the loop
        for pi, t in enumerate(texts):
            if t is None:
                echoed[pi] = await server.in_pool(lambda ids=prompts[pi]: server.tokenizer.decode(
                    ids, skip_special_tokens=False))
    job = await start_job(server, request, "completions", prompts, params, req.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n_choices = len(prompts) * req.n
    states = [ChoiceState() for _ in range(n_choices)]

    def echo_text(i: int) -> str:
        pi = i // req.n
        return texts[pi] if texts[pi] is not None else (echoed[pi] or "")

    def lp_block(st: ChoiceState, ids: list[int], lps: list, offset0: int) -> dict | None:
        if req.logprobs is None:
            return None
        tokens, tlp, top, offs = [], [], [], []
        off = offset0
        for tid, lp in zip(ids, lps):
            s = server.token_str(tid)
            tokens.append(s)
            tlp.append(lp.logprob)
            top.append({server.token_str(a): b for a, b in zip(lp.top_ids, lp.top_logprobs)}
                       if req.logprobs > 0 else None)
            offs.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}

    def choice_extra(c: dict, st: ChoiceState, i: int, new_ids: list[int] | None) -> dict:
        if st.stop_reason is not None or st.finish_reason is not None:
            c["stop_reason"] = st.stop_reason
        if req.return_token_ids:
            c["token_ids"] = new_ids if new_ids is not None else st.token_ids
            if not st.started or new_ids is None:
                c["prompt_token_ids"] = prompts[i // req.n]
        return c

    if req.stream:
        offsets = [0] * n_choices

        async def events():
            enc = ChunkEvents({"id": rid, "object": "text_completion", "created": created, "model": model})
            use_usage = req.stream_options.include_usage
            continuous = req.stream_options.continuous_usage_stats
            async for i, delta, new_ids, new_lp, fin in job.merged(states):
                st = states[i]
                if not (delta or new_ids or fin):
                    continue
                if req.echo and not st.started:
                    delta = echo_text(i) + delta
                c = {"index": i, "text": delta,
                     "logprobs": lp_block(st, new_ids, new_lp, offsets[i]),
                     "finish_reason": st.finish_reason}
                offsets[i] += len(delta)
                c = choice_extra(c, st, i, new_ids)
                st.started = True
                if use_usage:
                    yield enc.event(c, usage(states, req.n) if continuous else None)
                else:
                    yield enc.event(c)
            if use_usage:
                yield sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage(states, req.n)})

        return stream_job(job, events())

    await collect_job(request, job, states)
    choices = []
    for i, st in enumerate(states):
        prefix = echo_text(i) if req.echo else ""
        c = {"index": i, "text": prefix + st.text,
             "logprobs": lp_block(st, st.token_ids[:len(st.logprobs)], st.logprobs, 0),
             "finish_reason": st.finish_reason}
        choices.append(choice_extra(c, st, i, None))
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(states, req.n)})
