"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, plus
``/health``, ``/metrics`` and vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (which
lm-eval's ``local-completions`` model uses to tokenize like the server).

Handlers validate, tokenize and hand their choices to the one :class:`EngineLoop`; they never
touch the engine. A client that disconnects has its requests aborted (streams at once, whole
responses within half a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParams
from . import responses as R
from .chat_template import ChatTemplate, ChatTemplateError
from .engine_loop import Choice, EngineLoop, ErrorEvent, FinalEvent, LoopClosed, RequestGroup, TokenEvent
from .limits import BodySizeLimit
from .protocol import (
    MAX_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_common,
    error_body,
    stop_list,
)
from .tool_parsers import ToolCall, parse_tool_calls
from .tool_parsers import get as tool_call_format

log = logging.getLogger("hybrid.server")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there


@dataclass
class ServerSettings:
    model_name: str
    max_body_bytes: int = 8 * 2**20
    default_completion_tokens: int = 16  # OpenAI's default max_tokens for /v1/completions
    default_chat_tokens: int = 256
    shutdown_timeout: float = 10.0
    tool_call_parser: str | None = None  # a tool_parsers name: tool calls in chat output -> tool_calls


# Sampling when neither the request nor the checkpoint's generation_config.json says (OpenAI's defaults; the
# vLLM fields top_k, min_p, repetition_penalty off)
OPENAI_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


def create_app(engine, tokenizer, settings: ServerSettings, chat_template: ChatTemplate | None = None) -> FastAPI:
    """An app serving ``engine`` (its model's requests tokenized with ``tokenizer``). The engine loop
    starts with the app's lifespan and stops with it (in-flight requests get
    ``settings.shutdown_timeout`` seconds to finish, then are aborted)."""
    loop = EngineLoop(engine)
    template = chat_template or ChatTemplate()
    vocab = engine.model.config.vocab_size
    model_defaults = {k: v for k, v in (getattr(tokenizer, "sampling_defaults", None) or {}).items()
                      if k in OPENAI_SAMPLING}
    token_text = R.TokenText(tokenizer)
    tool_format = tool_call_format(settings.tool_call_parser) if settings.tool_call_parser else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, loop.stop, settings.shutdown_timeout)

    app = FastAPI(title="hybrid-lm", lifespan=lifespan)
    app.state.loop, app.state.settings = loop, settings
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    # ---- errors: OpenAI's error object everywhere ------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status < 500:
            loop.metrics.requests_rejected.inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _shape_error(request: Request, e: RequestValidationError):
        loop.metrics.requests_rejected.inc()
        message, param = describe_validation_error(e)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"),
                            status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), type="invalid_request_error" if e.status_code < 500
                                       else "server_error"), status_code=e.status_code)

    # ---- helpers ---------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(f"model {name!r} is not served here; this server serves {settings.model_name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def check_ids(ids: list[int], what: str = "prompt") -> list[int]:
        if not ids:
            raise APIError(f"{what} is empty: give at least one token (text or token ids)", param=what)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"{what} token id {bad} is out of range: the model's vocabulary has ids 0..{vocab - 1}",
                           param=what)
        return ids

    def check_length(prompts: list[list[int]], max_tokens: int | None, param: str) -> int:
        """Refuse (400, naming the limit and its flag) a prompt over the engine's ``max_prompt_tokens`` or a
        prompt + ``max_tokens`` over its ``max_model_len``; returns ``max_tokens``, or when the request gave
        none the default, shortened to what ``max_model_len`` leaves after the longest prompt (as vLLM)."""
        longest = max(len(p) for p in prompts)
        limit = engine.max_prompt_tokens
        if limit is not None and longest > limit:
            raise APIError(f"the prompt has {longest} tokens, more than this server's limit of {limit} prompt tokens "
                           "(hybrid serve --max-prompt-tokens); shorten the prompt", param=param,
                           code="context_length_exceeded")
        length = engine.max_model_len
        if max_tokens is None:
            default = settings.default_chat_tokens if param == "messages" else settings.default_completion_tokens
            return default if length is None else max(1, min(default, length - longest))
        if length is not None and longest + max_tokens > length:
            raise APIError(f"this server's maximum context length is {length} tokens (hybrid serve --max-model-len), "
                           f"but the request asks for {longest + max_tokens}: {longest} in the prompt + {max_tokens} "
                           "max_tokens; lower max_tokens or shorten the prompt", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def sampling(body, max_tokens: int, stop: tuple[str, ...], j: int) -> SamplingParams | None:
        if max_tokens == 0:
            return None
        # a field the request leaves out takes the checkpoint's generation_config.json default, else OpenAI's
        given = {k: getattr(body, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
        values = {**OPENAI_SAMPLING, **model_defaults, **{k: v for k, v in given.items() if v is not None}}
        try:
            return SamplingParams(
                max_new_tokens=max_tokens, temperature=values["temperature"], top_k=max(values["top_k"], 0),
                top_p=values["top_p"], min_p=values["min_p"] or 0.0,
                repetition_penalty=values["repetition_penalty"] or 1.0,
                seed=None if body.seed is None else body.seed + j, stop=stop,
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise APIError(str(e)) from e

    async def submit(group: RequestGroup) -> None:
        if not loop.alive:
            raise APIError("the engine loop is not running (the server is shutting down)", status=503,
                           type="server_error")
        try:
            await asyncio.wrap_future(loop.submit(group))
        except LoopClosed as e:
            raise APIError(str(e), status=503, type="server_error") from e
        except asyncio.CancelledError:  # the client left while its requests were being queued
            loop.abort(group)  # runs after the add (commands are FIFO), so nothing is left behind
            raise
        except ValueError as e:  # the engine's refusals: prompt + max_tokens beyond the cache, ...
            message = str(e)
            param = "max_tokens" if "max_new_tokens" in message else "prompt"
            message = message.replace("max_new_tokens", "max_tokens").replace(
                "give the engine a bigger cache", "start the server with a bigger --cache-bytes")
            raise APIError(message, param=param) from e

    def event_stream(group: RequestGroup, preamble: list[str], make_choice, make_body, rid: str, created: int,
                     prompt_tokens: int, usage: bool) -> StreamingResponse:
        """The SSE response of a streamed request: ``preamble`` chunks, then the choices' tokens as they come;
        the group is aborted however the stream ends (finished, client gone, error)."""
        async def events():
            try:
                for chunk in preamble:
                    yield chunk
                async for chunk in stream_choices(group, make_choice, make_body, rid, settings.model_name, created,
                                                  prompt_tokens, usage):
                    yield chunk
            finally:
                loop.abort(group)
        return StreamingResponse(events(), media_type="text/event-stream")

    async def collect(group: RequestGroup, request: Request) -> list[FinalEvent]:
        finals: dict[int, FinalEvent] = {}
        checked = time.monotonic()
        try:
            while len(finals) < len(group.choices):
                # token events arrive every step, so look at the connection by the clock, not on a timeout
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        raise ClientGone()
                    checked = time.monotonic()
                try:
                    event = await asyncio.wait_for(group.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, ErrorEvent):
                    raise APIError(event.message, status=500, type="server_error")
                if isinstance(event, FinalEvent):
                    finals[event.index] = event
        finally:
            loop.abort(group)  # a no-op once every choice finished
        return [finals[i] for i in range(len(group.choices))]

    def include_usage(body) -> bool:
        return bool((body.stream_options or {}).get("include_usage"))

    # ---- endpoints -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = loop.metrics.exposition(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "hybrid-lm"}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        def special(i):
            return None if i is None else tokenizer.decode([i], skip_special_tokens=False)
        return {"tokenizer_class": type(tokenizer).__name__, "bos_token": special(tokenizer.bos_token_id),
                "eos_token": special(tokenizer.eos_token_id), "pad_token": special(tokenizer.pad_token_id),
                "chat_template": None if template.is_default else template.source}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body)
        check_model(body.model)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", param="logprobs")
        if body.stream and body.logprobs is not None:
            raise APIError("logprobs with stream=true is not supported yet; ask without stream", param="logprobs")
        if body.best_of not in (None, body.n):
            raise APIError("best_of is not supported (it must equal n)", param="best_of")
        if body.suffix:
            raise APIError("suffix (insertion) is not supported", param="suffix")
        def tokenized() -> tuple[list[str], list[list[int]]]:
            texts, prompts = completion_prompts(body.prompt, tokenizer)
            return texts, [check_ids(p) for p in prompts]
        # tokenizing (and checking) a long prompt takes a while: off the event loop, which serves everyone else
        texts, prompts = await asyncio.to_thread(tokenized)
        max_tokens = check_length(prompts, body.max_tokens, "prompt")
        stop = stop_list(body.stop)
        n = body.n
        choices = [Choice(p, sampling(body, max_tokens, stop, j), body.logprobs, body.echo, body.priority)
                   for p in prompts for j in range(n)]
        group = RequestGroup(choices, asyncio.get_running_loop())
        await submit(group)
        rid, model, created = R.new_id("cmpl"), settings.model_name, int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)
        echo = [texts[i // n] if body.echo else "" for i in range(len(choices))]

        if body.stream:
            preamble = [R.sse(R.completion_body(rid, model, [R.completion_choice(i, text, None)], None,
                                                created=created, chunk=True))
                        for i, text in enumerate(echo)] if body.echo else []
            return event_stream(group, preamble, R.completion_choice, R.completion_body, rid, created, prompt_tokens,
                                include_usage(body))

        try:
            finals = await collect(group, request)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        out = []
        for i, f in enumerate(finals):
            lp = R.completion_logprobs(f.logprobs, token_text) if f.logprobs is not None else None
            out.append(R.completion_choice(i, echo[i] + f.output_text, f.finish_reason, lp))
        completion_tokens = sum(len(f.output_ids) for f in finals)
        return R.completion_body(rid, model, out, R.usage(prompt_tokens, completion_tokens), created=created)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_common(body)
        check_model(body.model)
        for tool in body.tools or []:  # offered to the template (the output is not constrained to a call)
            if tool.get("type") != "function" or not isinstance((tool.get("function") or {}).get("name"), str):
                raise APIError("each tool must be {'type': 'function', 'function': {'name': ..., ...}}",
                               param="tools")
        if body.tool_choice not in (None, "auto", "none"):
            raise APIError("tool_choice must be 'auto' or 'none': the output is not constrained to a named or "
                           "required tool call", param="tool_choice")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise APIError("only response_format {'type': 'text'} is supported", param="response_format")
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if body.stream and body.logprobs:
            raise APIError("logprobs with stream=true is not supported yet; ask without stream", param="logprobs")
        def chat_prompt() -> list[int]:  # rendering and tokenizing a long chat: off the event loop
            try:
                text = template.render([m.model_dump(exclude_none=True) for m in body.messages],
                                       add_generation_prompt=True,
                                       tools=body.tools if body.tools and body.tool_choice != "none" else None)
            except ChatTemplateError as e:
                raise APIError(str(e), param="messages") from e
            return check_ids(tokenizer.encode(text, add_special_tokens=False), "messages")
        prompt = await asyncio.to_thread(chat_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = check_length([prompt], max_tokens, "messages")
        stop = stop_list(body.stop) + template.stop
        logprobs = (top or 0) if body.logprobs else None
        choices = [Choice(prompt, sampling(body, max_tokens, stop, j), logprobs, priority=body.priority)
                   for j in range(body.n)]
        group = RequestGroup(choices, asyncio.get_running_loop())
        await submit(group)
        rid, model, created = R.new_id("chatcmpl"), settings.model_name, int(time.time())
        # tool calls in the output become tool_calls where tools were offered and may be called (as vLLM)
        parse_calls = tool_format is not None and bool(body.tools) and body.tool_choice != "none"
        tool_names = [t["function"]["name"] for t in body.tools] if parse_calls else None

        if body.stream:
            preamble = [R.sse(R.chat_body(rid, model, [R.chat_delta(i, {"role": "assistant", "content": ""})],
                                          None, created=created, chunk=True)) for i in range(len(choices))]
            if parse_calls:
                delta = tool_call_deltas([tool_format.stream(tool_names) for _ in choices])
            else:
                def delta(i, text, reason):
                    return R.chat_delta(i, {"content": text} if text or reason is None else {}, reason)
            return event_stream(group, preamble, delta, R.chat_body, rid, created, len(prompt), include_usage(body))

        try:
            finals = await collect(group, request)
        except ClientGone:
            return Response(status_code=499)
        out = []
        for i, f in enumerate(finals):
            lp = R.chat_logprobs(f.logprobs, token_text) if f.logprobs is not None else None
            content, calls = (parse_tool_calls(tool_format, f.output_text, tool_names) if parse_calls
                              else (f.output_text, []))
            out.append(R.chat_choice(i, content, "tool_calls" if calls else f.finish_reason, lp,
                                     [c.openai() for c in calls] or None))
        return R.chat_body(rid, model, out, R.usage(len(prompt), sum(len(f.output_ids) for f in finals)),
                           created=created)

    return app


def tool_call_deltas(streams: list):
    """The streamed chat choice maker (see :func:`stream_choices`) that runs each choice's text through its
    :class:`~.tool_parsers.ToolCallStream`: content deltas, and per call OpenAI's two tool_calls deltas (index, id,
    type and name with empty arguments, then the arguments); finish_reason ``tool_calls`` after a call."""
    def delta(i: int, text: str, reason: str | None) -> list[dict]:
        stream = streams[i]
        before = stream.calls
        pieces = stream.feed(text) + (stream.finish() if reason is not None else [])
        out = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                call = {"index": before, "id": piece.id, "type": "function",
                        "function": {"name": piece.name, "arguments": ""}}
                out.append(R.chat_delta(i, {"tool_calls": [call]}))
                out.append(R.chat_delta(i, {"tool_calls": [{"index": before,
                                                            "function": {"arguments": piece.arguments}}]}))
                before += 1
            elif piece:
                out.append(R.chat_delta(i, {"content": piece}))
        if reason is not None:
            out.append(R.chat_delta(i, {}, "tool_calls" if stream.calls else reason))
        elif not out:  # the step's text is held back (inside a call): the token's arrival still shows
            out.append(R.chat_delta(i, {"content": ""}))
        return out
    return delta


async def stream_choices(group: RequestGroup, make_choice, make_body, rid: str, model: str, created: int,
                         prompt_tokens: int, include_usage: bool):
    """Server-sent events for ``group``: a chunk per choice per step that made tokens, one with each
    choice's finish_reason (the last of them carries the request's ``usage``), with
    ``stream_options.include_usage`` OpenAI's extra usage-only chunk, and ``data: [DONE]``.

    ``make_choice(index, text, finish_reason)`` gives the chunk's choice, or a list of them (a chunk each; the
    last carries the finish_reason)."""
    finished, completion_tokens = 0, 0
    while finished < len(group.choices):
        event = await group.events.get()
        if isinstance(event, TokenEvent):
            # a chunk per step that made tokens, even when their text is held back (a partial UTF-8
            # character): clients see each token's arrival, as vLLM's streams show it
            if event.token_ids or event.text:
                for choice in _as_list(make_choice(event.index, event.text, None)):
                    yield R.sse(make_body(rid, model, [choice], None, created=created, chunk=True))
        elif isinstance(event, FinalEvent):
            finished += 1
            completion_tokens += len(event.output_ids)
            done = finished == len(group.choices)
            use = R.usage(prompt_tokens, completion_tokens) if done else None
            last = _as_list(make_choice(event.index, event.text, event.finish_reason))
            for choice in last[:-1]:
                yield R.sse(make_body(rid, model, [choice], None, created=created, chunk=True))
            yield R.sse(make_body(rid, model, last[-1:], use, created=created, chunk=True))
            if done and include_usage:
                yield R.sse(make_body(rid, model, [], use, created=created, chunk=True))
        elif isinstance(event, ErrorEvent):
            yield R.sse(error_body(event.message, type="server_error"))
            break
    yield R.SSE_DONE


def _as_list(choice: dict | list[dict]) -> list[dict]:
    return choice if isinstance(choice, list) else [choice]


def completion_prompts(prompt, tokenizer) -> tuple[list[str], list[list[int]]]:
    """``prompt`` (text, token ids, or a list of either) -> (each prompt's text, its ids)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt is empty: give text, token ids, or a list of them", param="prompt")
    if isinstance(prompt[0], str):
        return list(prompt), [tokenizer.encode(p) for p in prompt]
    if isinstance(prompt[0], int):
        prompt = [prompt]
    return [tokenizer.decode(p) for p in prompt], [list(p) for p in prompt]


def describe_validation_error(e: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as one sentence naming the field (and the JSON error, if any)."""
    errors = e.errors()
    if not errors:
        return "the request body is malformed", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not loc:
        return f"the request body must be a JSON object: {err.get('msg')}", None
    same_field = [x for x in errors if [str(y) for y in x.get("loc", ()) if y != "body"][:1] == loc[:1]]
    if len(same_field) > 1 and loc[0] in UNION_FIELDS:  # pydantic lists one complaint per allowed type
        return f"{loc[0]} has the wrong type: it must be {UNION_FIELDS[loc[0]]}", loc[0]
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{'.'.join(loc)}: {err.get('msg')}{more}", loc[0]


UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
                "stop": "a string or a list of strings"}
