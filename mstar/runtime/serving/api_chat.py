"""POST /v1/chat/completions: messages rendered by the model's chat template -> an assistant
message (`n` choices), in OpenAI's shape, with vLLM's extras (return_token_ids, stop_reason,
chat_template_kwargs, continuous usage stats)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_checks import (
    check_model,
    check_stop_ids,
    max_tokens_for,
    prompt_ids_for,
)
from mstar.runtime.serving.api_jobs import ChoiceState, collect_job, start_job, usage
from mstar.runtime.serving.api_sse import ChunkEvents, sse_event, stream_job

if TYPE_CHECKING:
    from mstar.runtime.serving.api_engine import Server


async def chat_prompt(server: Server, req: P.ChatRequest) -> list[int]:
    """The messages rendered by the model's chat template (on the tokenizer threads), as token ids."""
    server.need_tokenizer("messages", "chat completions")
    tok = server.tokenizer
    if not getattr(tok, "chat_template", None):
        raise P.bad("messages", "This model has no chat template; use /v1/completions.", "no_chat_template")
    # the template adds little to what the messages hold: longer messages cannot fit either
    server.check_text_length(sum(len(m["content"]) for m in req.messages), "messages")

    def render() -> str:
        return tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       **req.chat_template_kwargs)

    try:
        text = await server.in_pool(render)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise P.bad("messages", f"The chat template could not render these messages: {e}",
                    "invalid_messages") from None
    return await prompt_ids_for(server, text, req.add_special_tokens, "messages")


async def chat_completions(server: Server, request: Request, body: dict) -> Response:
    """POST /v1/chat/completions (non-streamed: a JSON body; streamed: SSE chunks)."""
    req = P.parse_chat(body)
    model = check_model(server.settings, req.model)
    ids = await chat_prompt(server, req)
    check_stop_ids(server, req.sampling)
    mt = max_tokens_for(server, len(ids), req, "messages")
    params = P.build_params(req.sampling, mt, max_tokens_field=req.max_tokens_field,
                            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                            logprobs_field="top_logprobs")
    job = await start_job(server, request, "chat", [ids], [params], req.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    states = [ChoiceState() for _ in range(req.n)]

    def lp_content(ids_: list[int], lps: list) -> list[dict]:
        out = []
        for tid, lp in zip(ids_, lps):
            s = server.token_str(tid)
            tops = [{"token": server.token_str(a), "logprob": b,
                     "bytes": list(server.token_str(a).encode("utf-8"))}
                    for a, b in zip(lp.top_ids, lp.top_logprobs)] if req.top_logprobs else []
            out.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
                        "top_logprobs": tops})
        return out

    def choice_extra(c: dict, st: ChoiceState, new_ids: list[int] | None) -> dict:
        if st.finish_reason is not None:
            c["stop_reason"] = st.stop_reason
        if req.return_token_ids:
            c["token_ids"] = new_ids if new_ids is not None else st.token_ids
            if new_ids is None:
                c["prompt_token_ids"] = ids
        return c

    if req.stream:
        async def events():
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            use_usage = req.stream_options.include_usage
            for i in range(req.n):
                c = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
                if req.return_token_ids:
                    c["prompt_token_ids"] = ids
                chunk = dict(base, choices=[c])
                if use_usage:
                    chunk["usage"] = None
                yield sse_event(chunk)
            enc = ChunkEvents(base)
            continuous = req.stream_options.continuous_usage_stats
            async for i, delta, new_ids, new_lp, fin in job.merged(states):
                st = states[i]
                if not (delta or new_ids or fin):
                    continue
                c = {"index": i, "delta": {"content": delta} if (delta or not fin) else {},
                     "logprobs": {"content": lp_content(new_ids, new_lp)} if req.logprobs else None,
                     "finish_reason": st.finish_reason}
                c = choice_extra(c, st, new_ids)
                if use_usage:
                    yield enc.event(c, usage(states, req.n) if continuous else None)
                else:
                    yield enc.event(c)
            if use_usage:
                yield sse_event(dict(base, choices=[], usage=usage(states, req.n)))

        return stream_job(job, events())

    await collect_job(request, job, states)
    choices = []
    for i, st in enumerate(states):
        c = {"index": i, "message": {"role": "assistant", "content": st.text},
             "logprobs": {"content": lp_content(st.token_ids[:len(st.logprobs)], st.logprobs)}
             if req.logprobs else None,
             "finish_reason": st.finish_reason}
        choices.append(choice_extra(c, st, None))
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(states, req.n)})
