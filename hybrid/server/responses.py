"""OpenAI response bodies: completions and chat, whole and as server-sent-event chunks; logprobs."""

from __future__ import annotations

import json
import time
import uuid

from .logprobs import TokenLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, choices: list[dict], usage_: dict | None, *, created: int | None = None,
                    chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_body(rid: str, model: str, choices: list[dict], usage_: dict | None, *, created: int | None = None,
              chunk: bool = False) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_choice(index: int, content: str | None, finish_reason: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class TokenText:
    """Each token id's own text (cached: the same ids recur across positions and requests)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(lp: TokenLogprobs, token_text: TokenText) -> dict:
    """The legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset.

    ``top_logprobs[i]`` maps token text to log-probability for the best alternatives and the token
    itself (as vLLM does); when two ids share a text the more likely one is kept."""
    tokens = [token_text(t) for t in lp.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = []
    for tid, chosen, top in zip(lp.token_ids, lp.logprobs, lp.top, strict=True):
        if top is None:
            tops.append(None)
            continue
        entry: dict[str, float] = {}
        for i, v in top:
            entry.setdefault(token_text(i), v)
        entry.setdefault(token_text(tid), chosen)
        tops.append(entry)
    return {"tokens": tokens, "token_logprobs": lp.logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lp: TokenLogprobs, token_text: TokenText) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(tid: int, value: float) -> dict:
        text = token_text(tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, chosen, top in zip(lp.token_ids, lp.logprobs, lp.top, strict=True):
        content.append({**item(tid, chosen), "top_logprobs": [item(i, v) for i, v in (top or [])]})
    return {"content": content}
