"""POST /tokenize and /detokenize, in vLLM's shapes (a prompt or chat messages -> token ids;
token ids -> text)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_chat import chat_prompt
from mstar.runtime.serving.api_checks import check_model

if TYPE_CHECKING:
    from mstar.runtime.serving.api_engine import Server


async def tokenize(server: Server, body: dict) -> dict:
    """POST /tokenize: a prompt or chat messages -> token ids (vLLM's shape)."""
    check_model(server.settings, P._str(body, "model"))
    if "messages" in body:
        P._check_unknown(body, frozenset({"model", "messages", "add_generation_prompt",
                                          "continue_final_message", "chat_template_kwargs",
                                          "add_special_tokens"}))
        req = P.parse_chat(dict(body))
        ids = await chat_prompt(server, req)
    else:
        P._check_unknown(body, frozenset({"model", "prompt", "add_special_tokens"}))
        prompt = P._str(body, "prompt")
        if prompt is None:
            raise P.bad("prompt", "Missing required parameter: 'prompt' (or 'messages').",
                        "missing_required_parameter")
        ids = await server.encode(prompt, P._bool(body, "add_special_tokens", True)) if prompt else []
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}


async def detokenize(server: Server, body: dict) -> dict:
    """POST /detokenize: token ids -> text (vLLM's shape), decoded on the tokenizer threads."""
    P._check_unknown(body, frozenset({"model", "tokens"}))
    check_model(server.settings, P._str(body, "model"))
    toks = body.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise P.bad("tokens", "Invalid 'tokens': expected an array of integer token ids.", "invalid_type")
    limit = server.settings.max_request_tokens
    if len(toks) > limit:
        raise P.bad("tokens", f"Invalid 'tokens': at most {limit} ids (--max-request-tokens).", "request_too_large")
    if any(t < 0 or t >= server.vocab_size for t in toks):
        raise P.bad("tokens", f"Invalid 'tokens': ids must be in [0, {server.vocab_size}).", "invalid_value")
    server.need_tokenizer("tokens", "detokenization")
    return {"prompt": await server.in_pool(lambda: server.tokenizer.decode(toks, skip_special_tokens=False))}
