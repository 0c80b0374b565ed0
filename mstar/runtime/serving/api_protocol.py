"""The OpenAI request shapes the server accepts, validated into engine terms.

Everything a client sends is checked here before it reaches the engine, and every
refusal is an `APIError` that renders as OpenAI's error body

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with `param` naming the offending field. Parsing is strict the way OpenAI's API is: an
unknown top-level field is a 400 naming it (a typo such as `max_token` must not be
silently ignored), and numbers must have the right type (`"0.5"` is not a number,
`true` is not an integer, NaN and infinities are refused).

Tokenization is not done here (the server owns the tokenizer); this module turns a
JSON body into a `CompletionRequest` / `ChatRequest` that carries validated
`SamplingParams` plus the prompt(s) still as text, token ids or chat messages.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mstar.runtime.engine.request import RequestError, SamplingParams

MAX_SEED = 2 ** 63  # seeds are reduced modulo this (the engine keeps them as int64)


class APIError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.headers = headers or {}
        self.counted = False  # already recorded in the server's metrics

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------
# JSON body

MAX_JSON_DEPTH = 64  # nesting levels of a request body; OpenAI's shapes need fewer than 10

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def nests_too_deeply(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON text nests more than `limit` levels, read without parsing it: the strings
    cut out, then the brackets' running count (C-speed passes: milliseconds for megabytes)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the common case: too few brackets to nest deeper
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    b = np.frombuffer(brackets, dtype=np.uint8)
    depth = np.cumsum(np.where((b == ord("[")) | (b == ord("{")), 1, -1))
    return bool(depth.size) and int(depth.max()) > limit


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body; malformed JSON, a non-object, nesting past MAX_JSON_DEPTH and
    strings that are not valid Unicode (a lone surrogate escape) are 400s."""
    if not raw.strip():
        raise bad(None, "The request body is empty; expected a JSON object.", "invalid_json")
    if nests_too_deeply(raw):
        raise bad(None, f"The JSON body nests more than {MAX_JSON_DEPTH} levels deep.", "invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(None, "The request body is not valid UTF-8.", "invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # unbalanced brackets the depth count cannot see as nesting
        raise bad(None, "The JSON body nests too deeply.", "invalid_json") from None
    except ValueError as e:  # JSONDecodeError is a ValueError (so is an integer of over 4300 digits)
        raise bad(None, f"We could not parse the JSON body of your request: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, f"The request body must be a JSON object, got {_json_type(body)}.", "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can make a lone surrogate (raw UTF-8 cannot)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad(None, "The JSON body contains a string that is not valid Unicode (a lone surrogate "
                            "escape such as \\ud800).", "invalid_json") from None
    return body


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


# ---------------------------------------------------------------------------------------
# typed field readers: each returns the value or the default, or raises a 400 naming the field

_MISSING = object()


def _get(body: dict, name: str, default: Any) -> Any:
    v = body.get(name, _MISSING)
    return default if v is _MISSING or v is None else v


def _int(body: dict, name: str, default: Any = None, lo: int | None = None, hi: int | None = None) -> Any:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"Invalid type for '{name}': expected an integer, but got {_json_type(v)} instead.",
                  "invalid_type")
    if lo is not None and v < lo:
        raise bad(name, f"Invalid '{name}': integer below minimum value. Expected a value >= {lo}, "
                        f"but got {v} instead.", "integer_below_min_value")
    if hi is not None and v > hi:
        raise bad(name, f"Invalid '{name}': integer above maximum value. Expected a value <= {hi}, "
                        f"but got {v} instead.", "integer_above_max_value")
    return v


def _num(body: dict, name: str, default: Any = None) -> Any:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"Invalid type for '{name}': expected a number, but got {_json_type(v)} instead.",
                  "invalid_type")
    try:
        f = float(v)  # an integer past float's range (10**400) raises here
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise bad(name, f"Invalid '{name}': expected a finite number.", "invalid_value")
    return f


def _bool(body: dict, name: str, default: Any = None) -> Any:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"Invalid type for '{name}': expected a boolean, but got {_json_type(v)} instead.",
                  "invalid_type")
    return v


def _str(body: dict, name: str, default: Any = None) -> Any:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return default
    if not isinstance(v, str):
        raise bad(name, f"Invalid type for '{name}': expected a string, but got {_json_type(v)} instead.",
                  "invalid_type")
    return v


def _obj(body: dict, name: str) -> dict | None:
    v = _get(body, name, _MISSING)
    if v is _MISSING:
        return None
    if not isinstance(v, dict):
        raise bad(name, f"Invalid type for '{name}': expected an object, but got {_json_type(v)} instead.",
                  "invalid_type")
    return v


def _check_unknown(body: dict, allowed: frozenset[str]) -> None:
    for k in body:
        if k not in allowed:
            raise bad(k, f"Unrecognized request argument supplied: {k}", "unrecognized_argument")


# ---------------------------------------------------------------------------------------
# the parts shared by both endpoints

_SAMPLING_FIELDS = frozenset({
    "model", "n", "best_of", "stop", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
    # vLLM-style extras
    "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "return_token_ids", "add_special_tokens", "echo",
})


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass
class _Common:
    model: str | None
    params: SamplingParams
    max_tokens: int | None  # None: up to the context length
    max_tokens_field: str  # the name the client used ("max_tokens" or "max_completion_tokens")
    stream: bool
    stream_options: StreamOptions
    return_token_ids: bool
    add_special_tokens: bool
    echo: bool


def _parse_common(body: dict, *, max_tokens_default: int | None, chat: bool) -> dict[str, Any]:
    model = _str(body, "model")
    stream = _bool(body, "stream", False)
    so = _obj(body, "stream_options")
    opts = StreamOptions()
    if so is not None:
        if not stream:
            raise bad("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is true.")
        for k in so:
            if k not in ("include_usage", "continuous_usage_stats"):
                raise bad(f"stream_options.{k}", f"Unrecognized stream option: {k}", "unrecognized_argument")
        for k in ("include_usage", "continuous_usage_stats"):
            v = so.get(k)
            if v is not None and not isinstance(v, bool):
                raise bad(f"stream_options.{k}", f"Invalid type for 'stream_options.{k}': expected a boolean, "
                                                 f"but got {_json_type(v)} instead.", "invalid_type")
            setattr(opts, k, bool(v))

    # max_tokens / max_completion_tokens (chat prefers the newer name)
    mt_field = "max_tokens"
    max_tokens = max_tokens_default
    if chat and body.get("max_completion_tokens") is not None:
        mt_field = "max_completion_tokens"
        max_tokens = _int(body, "max_completion_tokens", lo=1)
    elif "max_tokens" in body:
        max_tokens = _int(body, "max_tokens", None, lo=1)  # null: up to the context length
    if chat:
        _int(body, "max_tokens", None, lo=1)  # type-check even when shadowed

    n = _int(body, "n", 1, lo=1, hi=128)
    best_of = _int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise bad("best_of", "best_of is not supported (it must equal n when given).", "unsupported_value")

    stop = _get(body, "stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "Invalid type for 'stop': expected a string or an array of strings.", "invalid_type")
    if any(s == "" for s in stop):
        raise bad("stop", "Invalid 'stop': stop strings must not be empty.", "invalid_value")
    if len(stop) > SamplingParams.MAX_STOP or any(len(s) > SamplingParams.MAX_STOP_CHARS for s in stop):
        raise bad("stop", f"Invalid 'stop': at most {SamplingParams.MAX_STOP} stop strings of at most "
                          f"{SamplingParams.MAX_STOP_CHARS} characters each.", "invalid_value")

    stop_token_ids = _get(body, "stop_token_ids", [])
    if not isinstance(stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise bad("stop_token_ids", "Invalid type for 'stop_token_ids': expected an array of integers.",
                  "invalid_type")
    if len(stop_token_ids) > SamplingParams.MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"Invalid 'stop_token_ids': at most {SamplingParams.MAX_STOP_TOKEN_IDS} "
                                    "ids.", "invalid_value")

    logit_bias = _obj(body, "logit_bias")
    if logit_bias:
        raise bad("logit_bias", "logit_bias is not supported by this server.", "unsupported_parameter")
    _str(body, "user")

    seed = _int(body, "seed", None, lo=-(2 ** 63), hi=2 ** 64 - 1)
    if seed is not None:
        seed %= MAX_SEED

    top_k = _int(body, "top_k", 0, lo=-1, hi=SamplingParams.MAX_TOP_K)
    sp = dict(
        n=1,  # the server fans n out into n engine requests (one per choice)
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        top_k=top_k,
        min_p=_num(body, "min_p", 0.0),
        seed=seed,
        presence_penalty=_num(body, "presence_penalty", 0.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        min_tokens=_int(body, "min_tokens", 0, lo=0),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
    )
    _bool(body, "spaces_between_special_tokens")
    if any(t < 0 for t in stop_token_ids):
        raise bad("stop_token_ids", "Invalid 'stop_token_ids': token ids must be non-negative.", "invalid_value")
    return dict(model=model, sampling=sp, n=n, max_tokens=max_tokens, max_tokens_field=mt_field, stream=stream,
                stream_options=opts, return_token_ids=_bool(body, "return_token_ids", False))


def build_params(sampling: dict[str, Any], max_tokens: int, *, max_tokens_field: str = "max_tokens",
                 logprobs: int | None = None, logprobs_field: str = "logprobs") -> SamplingParams:
    """SamplingParams for one choice, validated; its errors become 400s naming the client's field."""
    d = dict(sampling)
    d["max_tokens"] = max_tokens
    d["logprobs"] = logprobs
    if d["min_tokens"] > max_tokens:
        raise bad("min_tokens", f"Invalid 'min_tokens': must be <= {max_tokens_field} ({max_tokens}), "
                                f"got {d['min_tokens']}.", "invalid_value")
    try:
        return SamplingParams(**d).validate()
    except RequestError as e:
        name = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(e.field, e.field)
        raise bad(name, f"Invalid '{name}': {e.message}", "invalid_value") from None


# ---------------------------------------------------------------------------------------
# /v1/completions

COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "max_tokens", "logprobs", "suffix"}


@dataclass
class CompletionRequest(_Common):
    prompts: list = field(default_factory=list)  # each a str or a list[int]
    n: int = 1
    sampling: dict = field(default_factory=dict)
    logprobs: int | None = None


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _check_unknown(body, COMPLETION_FIELDS)
    c = _parse_common(body, max_tokens_default=16, chat=False)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter")
    prompts = _parse_prompts(body["prompt"])
    if _get(body, "suffix", None) is not None:
        _str(body, "suffix")
        raise bad("suffix", "suffix is not supported by this server.", "unsupported_parameter")
    logprobs = _int(body, "logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    echo = _bool(body, "echo", False)
    if echo and logprobs is not None:
        raise bad("echo", "echo together with logprobs (prompt logprobs) is not supported.",
                  "unsupported_value")
    return CompletionRequest(
        model=c["model"], params=None, max_tokens=c["max_tokens"], max_tokens_field=c["max_tokens_field"],
        stream=c["stream"], stream_options=c["stream_options"], return_token_ids=c["return_token_ids"],
        add_special_tokens=_bool(body, "add_special_tokens", True), echo=echo,
        prompts=prompts, n=c["n"], sampling=c["sampling"], logprobs=logprobs)


def _parse_prompts(p: Any) -> list:
    def ids_ok(lst):
        return all(isinstance(t, int) and not isinstance(t, bool) for t in lst)

    if isinstance(p, str):
        return [p]
    if isinstance(p, list):
        if not p:
            raise bad("prompt", "Invalid 'prompt': the prompt must not be empty.", "invalid_value")
        if all(isinstance(x, str) for x in p):
            return list(p)
        if ids_ok(p):
            return [list(p)]
        if all(isinstance(x, list) for x in p):
            for i, x in enumerate(p):
                if not x:
                    raise bad("prompt", f"Invalid 'prompt[{i}]': a token-id prompt must not be empty.",
                              "invalid_value")
                if not ids_ok(x):
                    raise bad("prompt", f"Invalid 'prompt[{i}]': expected an array of integer token ids.",
                              "invalid_type")
            return [list(x) for x in p]
    raise bad("prompt", "Invalid type for 'prompt': expected a string, an array of strings, an array of "
                        "token ids, or an array of token-id arrays.", "invalid_type")


# ---------------------------------------------------------------------------------------
# /v1/chat/completions

CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "metadata", "store", "service_tier",
    "modalities", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest(_Common):
    messages: list = field(default_factory=list)  # normalised for the chat template
    n: int = 1
    sampling: dict = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _check_unknown(body, CHAT_FIELDS)
    c = _parse_common(body, max_tokens_default=None, chat=True)
    if "messages" not in body or body["messages"] is None:
        raise bad("messages", "Missing required parameter: 'messages'.", "missing_required_parameter")
    messages = _parse_messages(body["messages"])
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.",
                  "invalid_value")
    rf = _obj(body, "response_format")
    if rf is not None and rf.get("type", "text") != "text":
        raise bad("response_format", "Only response_format {'type': 'text'} is supported by this server.",
                  "unsupported_value")
    tools = _get(body, "tools", None)
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "Invalid type for 'tools': expected an array.", "invalid_type")
        if tools:
            raise bad("tools", "Tool calling is not supported by this server.", "unsupported_parameter")
    tc = _get(body, "tool_choice", None)
    if tc is not None and tc not in ("none", "auto"):
        raise bad("tool_choice", "Tool calling is not supported by this server.", "unsupported_parameter")
    for name in ("functions", "function_call"):
        if _get(body, name, None):
            raise bad(name, "Function calling is not supported by this server.", "unsupported_parameter")
    mods = _get(body, "modalities", None)
    if mods is not None and mods != ["text"]:
        raise bad("modalities", "Only the 'text' modality is supported.", "unsupported_value")
    _bool(body, "parallel_tool_calls")
    _bool(body, "store")
    _obj(body, "metadata")
    _str(body, "service_tier")
    if _bool(body, "echo", False):
        raise bad("echo", "echo is not supported for chat completions.", "unsupported_value")
    ctk = _obj(body, "chat_template_kwargs") or {}
    for k in ctk:
        if k in ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                 "chat_template", "tools", "documents", "return_dict", "return_tensors"):
            raise bad("chat_template_kwargs", f"Invalid 'chat_template_kwargs': '{k}' cannot be set here.",
                      "invalid_value")
    agp = _bool(body, "add_generation_prompt", True)
    cfm = _bool(body, "continue_final_message", False)
    if agp and cfm and "add_generation_prompt" in body:
        raise bad("continue_final_message",
                  "continue_final_message and add_generation_prompt cannot both be true.", "invalid_value")
    if cfm:
        agp = False
        if messages[-1]["role"] != "assistant":
            raise bad("continue_final_message", "continue_final_message needs a final assistant message.",
                      "invalid_value")
    return ChatRequest(
        model=c["model"], params=None, max_tokens=c["max_tokens"], max_tokens_field=c["max_tokens_field"],
        stream=c["stream"], stream_options=c["stream_options"], return_token_ids=c["return_token_ids"],
        add_special_tokens=_bool(body, "add_special_tokens", False), echo=False,
        messages=messages, n=c["n"], sampling=c["sampling"], logprobs=logprobs,
        top_logprobs=top, add_generation_prompt=agp, continue_final_message=cfm, chat_template_kwargs=ctk)


def _parse_messages(msgs: Any) -> list[dict[str, Any]]:
    if not isinstance(msgs, list):
        raise bad("messages", f"Invalid type for 'messages': expected an array of objects, but got "
                              f"{_json_type(msgs)} instead.", "invalid_type")
    if not msgs:
        raise bad("messages", "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                  "empty_array")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"Invalid type for '{where}': expected an object, but got {_json_type(m)} instead.",
                      "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{where}.role", f"Missing or invalid '{where}.role': expected one of {list(_ROLES)}.",
                      "invalid_value")
        if role not in _ROLES:
            raise bad(f"{where}.role", f"Invalid value for '{where}.role': '{role}'. Supported values are: "
                                       f"{', '.join(repr(r) for r in _ROLES)}.", "invalid_value")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad(pw, f"Invalid '{pw}': expected an object with a 'type'.", "invalid_type")
                if part["type"] != "text":
                    raise bad(pw, f"Invalid '{pw}.type': only 'text' content parts are supported by this "
                                  f"model, got '{part['type']}'.", "unsupported_value")
                if not isinstance(part.get("text"), str):
                    raise bad(f"{pw}.text", f"Invalid '{pw}.text': expected a string.", "invalid_type")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            if role != "assistant":
                raise bad(f"{where}.content", f"Missing '{where}.content': only assistant messages may omit it.",
                          "missing_required_parameter")
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"Invalid type for '{where}.content': expected a string or an array "
                                          f"of content parts, but got {_json_type(content)} instead.",
                      "invalid_type")
        msg = {k: v for k, v in m.items() if k not in ("role", "content")}
        if "name" in msg and not isinstance(msg["name"], str):
            raise bad(f"{where}.name", f"Invalid type for '{where}.name': expected a string.", "invalid_type")
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = content
        out.append(msg)
    return out
