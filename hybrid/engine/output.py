"""The output processor: a sampled token becomes a request's output — stop ids, stop strings, the length
limit and finish reasons, and incremental detokenisation for streaming."""

from __future__ import annotations

from .request import Request, RequestOutput


def eos_ids(tokenizer) -> tuple[int, ...]:
    """Every end-of-sequence id of ``tokenizer`` (ours list them all; others give one or none)."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = () if eos is None else (eos,)
    return tuple(ids)


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Earliest index at which any stop string occurs in ``text[start:]``."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def process_token(req: Request, token: int) -> tuple[RequestOutput, str | None]:
    """Append ``token`` to ``req`` (unless it is a stop id) and say what the caller streams back, with the
    finish reason when this token ends the request (the caller then frees its cache)."""
    p = req.params
    if token in req.stop_ids:
        text = req.decoder.flush() if req.decoder is not None else ""
        return RequestOutput(req.request_id, [], text, True, "stop"), "stop"
    req.output.append(token)
    done = len(req.output) >= p.max_new_tokens
    text = ""
    if req.decoder is not None:
        seen = len(req.decoder.text)
        text = req.decoder.push([token])
        if done:
            text += req.decoder.flush()
        if p.stop:
            cut = find_stop(req.decoder.text, p.stop, max(0, seen - max(map(len, p.stop)) + 1))
            if cut is not None:
                text = req.decoder.text[seen:cut]
                req.decoder.text = req.decoder.text[:cut]
                return RequestOutput(req.request_id, [token], text, True, "stop"), "stop"
    reason = "length" if done else None
    return RequestOutput(req.request_id, [token], text, done, reason), reason
