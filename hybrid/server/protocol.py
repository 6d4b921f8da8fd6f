"""The OpenAI request bodies (pydantic) and the error object every refusal is sent as.

Only the *shape* of a request is checked here (pydantic answers a wrong type or a missing field);
value limits (temperature >= 0, top_p in (0, 1], n >= 1, ...) are checked by :func:`check_common`
so that each refusal is a 400 whose message names the field and its limit, as OpenAI's are.
Fields OpenAI defines but this server does not implement are refused when set to anything other
than their no-op value, never silently ignored; fields nobody defines are ignored (clients send
extras such as ``user``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # as vLLM: top alternatives per position
MAX_N = 128  # choices per prompt: each is an engine request, so a bound keeps one client from flooding the queue


class APIError(Exception):
    """A refusal sent as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields, which the engine implements
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # vLLM's: lower values are scheduled first (ties: first come, first served); may be negative
    priority: int = 0


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template untouched

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body (what lm-eval's remote tokenizer sends)."""

    model_config = ConfigDict(extra="ignore")
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


def check_common(req: _Request) -> None:
    """The value limits every generation request shares; raises :class:`APIError` (400)."""
    def bad(param: str, message: str) -> APIError:
        return APIError(message, param=param)

    if req.n < 1:
        raise bad("n", f"n must be >= 1 (the number of choices per prompt), got {req.n}")
    if req.n > MAX_N:
        raise bad("n", f"n must be <= {MAX_N}, got {req.n}")
    if not -2**63 <= req.priority < 2**63:
        raise bad("priority", f"priority must be a signed 64-bit integer (lower runs first), got {req.priority}")
    if req.seed is not None and not -2**63 <= req.seed < 2**63:
        raise bad("seed", f"seed must be a signed 64-bit integer, got {req.seed}")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise bad("max_tokens", f"max_tokens must be >= 0, got {req.max_tokens}")
    if req.temperature is not None and req.temperature < 0:
        raise bad("temperature", f"temperature must be >= 0 (0 is greedy), got {req.temperature}")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_k is not None and req.top_k < -1:
        raise bad("top_k", f"top_k must be >= 0 (0 or -1 is off), got {req.top_k}")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise bad("min_p", f"min_p must be in [0, 1], got {req.min_p}")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise bad("repetition_penalty", f"repetition_penalty must be > 0 (1 is off), got {req.repetition_penalty}")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(not s for s in stops):
        raise bad("stop", "stop strings must be non-empty")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad(name, f"{name} is not supported by this server; leave it at 0 "
                            "(repetition_penalty is the penalty the engine implements)")
    if req.logit_bias:
        raise bad("logit_bias", "logit_bias is not supported by this server")


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())
