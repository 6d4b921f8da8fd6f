"""Refuse request bodies over a size limit before anything parses them (413, OpenAI's error object).

A pure ASGI middleware: a ``Content-Length`` over the limit is answered at once without reading
the body; a body without one (chunked) is read here as it arrives, refused as soon as it passes
the limit, else handed on whole, so no more than the limit is ever held in memory.
"""

from __future__ import annotations

import json

from .protocol import error_body


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await self._refuse(send, 400, "the Content-Length header is not a number")
            if declared > self.max_bytes:
                return await self._refuse(send, 413, self._message(f"{declared} bytes"))
        if length is not None:
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read it here, counting, and replay it to the app
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self._refuse(send, 413, self._message(f"more than {self.max_bytes} bytes"))
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        await self.app(scope, replay, send)

    def _message(self, size: str) -> str:
        return (f"the request body ({size}) is over this server's limit of {self.max_bytes} bytes "
                "(hybrid serve --max-body-bytes)")

    async def _refuse(self, send, status: int, message: str) -> None:
        body = json.dumps(error_body(message, code="request_too_large" if status == 413 else None)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
