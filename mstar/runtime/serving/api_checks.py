"""Checks of a parsed request against the served model (names, vocabulary, context length),
shared by the completion, chat, tokenize and transcription endpoints. Each failure is an
APIError with OpenAI's status, param and code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_protocol import APIError

if TYPE_CHECKING:
    from mstar.runtime.serving.api_engine import Server
    from mstar.runtime.serving.api_server import ServerSettings


def check_model(settings: ServerSettings, model: str | None) -> str:
    """The served model name a request asks for (None: the first one)."""
    if model is None:
        return settings.served_model_names[0]
    if model not in settings.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist. This server serves "
                            f"{', '.join(settings.served_model_names)}.", param="model",
                       code="model_not_found")
    return model


async def prompt_ids_for(server: Server, p, add_special_tokens: bool, where: str) -> list[int]:
    """A prompt (text, or token ids) as token ids, checked against the vocabulary (text is
    encoded on the tokenizer threads, after a length bound)."""
    if isinstance(p, str):
        ids = await server.encode(p, add_special_tokens, where)
    else:
        ids = p
        V = server.vocab_size
        for t in ids:
            if t < 0 or t >= V:
                raise P.bad(where, f"Invalid '{where}': token id {t} is out of range [0, {V}).",
                            "invalid_value")
    if not ids:
        raise P.bad(where, f"Invalid '{where}': the prompt is empty.", "invalid_value")
    return ids


def max_tokens_for(server: Server, n_prompt: int, req, where: str) -> int:
    """The request's max_tokens, or all the context the prompt leaves when it has none."""
    L = server.max_model_len
    if n_prompt >= L:
        raise APIError(400, f"This model's maximum context length is {L} tokens. However, your prompt has "
                            f"{n_prompt} tokens. Please reduce the length of the {where}.", param=where,
                       code="context_length_exceeded")
    mt = req.max_tokens
    if mt is None:
        return L - n_prompt
    if n_prompt + mt > L:
        raise APIError(400, f"This model's maximum context length is {L} tokens. However, you requested "
                            f"{n_prompt + mt} tokens ({n_prompt} in the {where}, {mt} in the completion). "
                            f"Please reduce the length of the {where} or {req.max_tokens_field}.",
                       param=req.max_tokens_field, code="context_length_exceeded")
    return mt


def check_stop_ids(server: Server, sampling: dict) -> None:
    if sampling["stop"]:
        server.need_tokenizer("stop", "stop strings")
    V = server.vocab_size
    for t in sampling["stop_token_ids"]:
        if V and t >= V:
            raise P.bad("stop_token_ids", f"Invalid 'stop_token_ids': token id {t} is out of range [0, {V}).",
                        "invalid_value")


class PromptBudget:
    """The prompt tokens of one request, at most --max-request-tokens together: a lower bound
    (token ids as they are, text as characters / the longest token) is checked before anything
    is encoded, then the exact count as each prompt is encoded."""

    def __init__(self, server: Server, prompts: list, where: str):
        self.limit = server.settings.max_request_tokens
        self.where = where
        self.used = 0
        low = sum(len(p) if not isinstance(p, str) else -(-len(p) // server.max_token_chars) for p in prompts)
        self._check(low)

    def take(self, n: int) -> None:
        self.used += n
        self._check(self.used)

    def _check(self, n: int) -> None:
        if n > self.limit:
            raise APIError(400, f"The request's prompts have {n} or more tokens together; this server takes at "
                                f"most {self.limit} per request (--max-request-tokens).", param=self.where,
                           code="request_too_large")
