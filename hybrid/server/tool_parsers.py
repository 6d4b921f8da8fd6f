"""Tool calls in a model's output text -> OpenAI ``tool_calls`` (``hybrid serve --tool-call-parser NAME``).

A chat template that offers ``tools`` teaches the model a text format for calling them; the model's output is
plain text, and a parser for that format turns the calls in it into OpenAI's ``tool_calls`` (as vLLM's
``--enable-auto-tool-choice --tool-call-parser NAME`` does). Formats here:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them anywhere in the
  output — what the Qwen2.5 / Qwen3 / Hermes 2 Pro templates ask for. A last call without its closing tag (the
  model stopped at EOS first) still counts if its JSON is complete, as in vLLM.
- ``llama3_json``: the whole output is one JSON object ``{"name": ..., "parameters" (or "arguments"): {...}}``,
  or several separated by ``;`` (optionally after ``<|python_tag|>``) — Llama 3.1 / 3.2's JSON tool template.

One :class:`ToolCallStream` per choice reads the output as it is generated (:meth:`~ToolCallStream.feed`,
then :meth:`~ToolCallStream.finish`) and hands back content text and whole :class:`ToolCall` s in order; the
non-streamed response runs the same stream over the whole text (:func:`parse_tool_calls`), so a streamed and a
whole response of one output agree. Text that may be the start of a call (a partial ``<tool_c`` at the end of
a chunk, or everything from an opening tag to its closing one) is held back, never sent as content.

What the content is: the text outside the calls, unchanged when there are no calls. Whitespace between text
and a call is dropped (``"Sure.\\n<tool_call>...</tool_call>\\n"`` -> ``"Sure."``; only whitespace -> no
content), except that text on both sides of calls keeps the whitespace that stood before them. A call whose
JSON does not parse (or lacks a name) is left in the content as the model wrote it, and logged. A call to a
name the request did not offer is returned as a tool call, as vLLM does (its parsers do not check names);
it is logged, and the client decides (OpenAI's agents answer it with a "tool not found" message).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("hybrid.server")


def new_call_id() -> str:
    """``call_`` and 24 random hex digits: the shape of OpenAI's tool call ids."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it (clients json.loads it)
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        """The ``message.tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class MalformedCall(ValueError):
    """The text between a call's markers is not a call (bad JSON, no name, arguments not an object)."""


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes calls: the markers around them and how the text between them parses.

    ``starts``: the texts that open a call. ``end``: the text that closes one (None: the call runs to the end of
    the output). ``at_start_only``: a call may only open before any other (non-whitespace) text.
    ``start_in_body``: the opening text is part of what is parsed (llama3_json's ``{``)."""

    name: str
    description: str
    starts: tuple[str, ...]
    end: str | None
    parse_body: Callable[[str], list[tuple[str, dict]]]  # the text between the markers; raises MalformedCall
    at_start_only: bool = False
    start_in_body: bool = False

    def stream(self, tool_names=None) -> ToolCallStream:
        return ToolCallStream(self, tool_names)


def _call_of(obj, arguments_keys: tuple[str, ...]) -> tuple[str, dict]:
    """One ``{"name": ..., "arguments": {...}}`` object -> (name, arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise MalformedCall(f"a tool call is a JSON object with a string 'name', got {json.dumps(obj)[:200]}")
    present = [k for k in arguments_keys if k in obj]
    if len(present) > 1:
        raise MalformedCall(f"tool call {obj['name']!r} has both {present[0]!r} and {present[1]!r}")
    args = obj[present[0]] if present else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise MalformedCall(f"tool call {obj['name']!r}: its arguments string is not JSON ({e})") from None
    if not isinstance(args, dict):
        raise MalformedCall(f"tool call {obj['name']!r}: arguments must be a JSON object, got {type(args).__name__}")
    return obj["name"], args


def _hermes_body(body: str) -> list[tuple[str, dict]]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise MalformedCall(f"not JSON ({e})") from None
    return [_call_of(obj, ("arguments",))]


def _llama3_body(body: str) -> list[tuple[str, dict]]:
    """JSON objects separated by ``;`` (whitespace around them allowed)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(body) and body[at].isspace():
            at += 1
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"not JSON ({e})") from None
        calls.append(_call_of(obj, ("parameters", "arguments")))
        rest = body[at:].lstrip()
        if not rest:
            return calls
        if rest[0] != ";":
            raise MalformedCall(f"after a call comes ';' and the next one, got {rest[:40]!r}")
        at = len(body) - len(rest) + 1


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    ToolCallFormat("hermes", "<tool_call>{JSON}</tool_call>: Qwen2.5, Qwen3, Hermes 2 Pro",
                   ("<tool_call>",), "</tool_call>", _hermes_body),
    ToolCallFormat("llama3_json", "the output is {JSON}[; {JSON}...]: Llama 3.1/3.2 JSON tool calling",
                   ("<|python_tag|>", "{"), None, _llama3_body, at_start_only=True, start_in_body=True),
)}


def names() -> list[str]:
    return sorted(FORMATS)


def get(name: str) -> ToolCallFormat:
    """The format called ``name``; a ValueError listing the known names otherwise."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(names())}")
    return FORMATS[name]


class ToolCallStream:
    """One choice's output, read as it is generated: ``feed(text)`` and finally ``finish()`` each return the
    new pieces in order — ``str`` content, or a :class:`ToolCall`. ``calls`` counts the calls handed out."""

    def __init__(self, fmt: ToolCallFormat, tool_names=None):
        self.fmt = fmt
        self.tool_names = None if tool_names is None else set(tool_names)
        self.calls = 0
        self._buf = ""  # text not yet handed out: a partial opening marker, or a call's body so far
        self._marker: str | None = None  # the opening marker of the call being read (None: reading text)
        self._text_seen = False  # non-whitespace text came before (at_start_only formats can no longer call)
        self._ws = ""  # trailing whitespace of the content, held until text follows it
        self._ws_before_call = False  # a call came after the held whitespace (dropped unless text follows)
        self._after_call = False  # drop whitespace that follows a call
        self._content_out = False  # some content was handed out
        self._out: list = []

    # ---- reading --------------------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        self._buf += text
        self._scan()
        return self._take()

    def finish(self) -> list:
        """The end of the output: an unclosed call is parsed as it stands; held text is let go."""
        if self._marker is not None:
            self._close(self._buf, "")
        elif self._buf:
            self._text(self._buf)
        self._buf = ""
        if self._ws and not self._ws_before_call:
            self._out.append(self._ws)
        self._ws = ""
        return self._take()

    def _scan(self) -> None:
        while self._buf:
            if self._marker is None:
                if not self._scan_text():
                    return
            else:
                end = self.fmt.end
                if end is None or end not in self._buf:
                    return  # the call goes on (to its closing marker, or to the end of the output)
                at = self._buf.index(end)
                body, self._buf = self._buf[:at], self._buf[at + len(end):]
                self._close(body, end)

    def _scan_text(self) -> bool:
        """Hand out the text before the next opening marker and enter the call; False: wait for more text."""
        buf = self._buf
        if self.fmt.at_start_only:
            if self._text_seen:
                self._text(buf)
                self._buf = ""
                return False
            lead = len(buf) - len(buf.lstrip())
            rest = buf[lead:]
            if not rest:
                return False  # only whitespace so far: a call may still open
            marker = next((m for m in self.fmt.starts if rest.startswith(m)), None)
            if marker is None:
                if any(m.startswith(rest) for m in self.fmt.starts):
                    return False  # could still be the marker
                self._text_seen = True
                return True  # plain text: handed out on the next pass
            self._open(buf[:lead], marker, rest[len(marker):])
            return True
        found = [(buf.find(m), m) for m in self.fmt.starts if m in buf]
        if found:
            at, marker = min(found)
            self._open(buf[:at], marker, buf[at + len(marker):])
            return True
        keep = _partial_marker_len(buf, self.fmt.starts)
        self._text(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _open(self, before: str, marker: str, rest: str) -> None:
        self._text(before)
        self._marker = marker
        self._buf = (marker if self.fmt.start_in_body else "") + rest

    def _close(self, body: str, end: str) -> None:
        marker, self._marker = self._marker, None
        raw = (body if self.fmt.start_in_body else marker + body) + end
        try:
            calls = self.fmt.parse_body(body.removeprefix("<|python_tag|>") if self.fmt.start_in_body else body)
        except MalformedCall as e:
            log.warning("tool call parser %s: the model's call is malformed (%s); returned as content: %.200r",
                        self.fmt.name, e, raw)
            self._text(raw)
            return
        for name, args in calls:
            if self.tool_names is not None and name not in self.tool_names:
                log.warning("tool call parser %s: the model called %r, which the request did not offer (%s); "
                            "returned as a tool call, as vLLM does", self.fmt.name, name,
                            ", ".join(sorted(self.tool_names)) or "none")
            self._out.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            self.calls += 1
        self._after_call, self._ws_before_call = True, True

    # ---- content and its whitespace -------------------------------------------------------------------
    def _text(self, s: str) -> None:
        if self._after_call:
            s = s.lstrip()
            if not s:
                return
            self._after_call = False
        core = s.rstrip()
        if core:
            keep_ws = self._content_out or not self._ws_before_call  # whitespace before calls, text on both sides
            self._text_seen = self._content_out = True
            self._out.append((self._ws if keep_ws else "") + core)
            self._ws, self._ws_before_call = s[len(core):], False
        else:
            self._ws += s

    def _take(self) -> list:
        out, self._out = self._out, []
        return out


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that a marker starts with (it may be the marker's start)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def parse_tool_calls(fmt: ToolCallFormat, text: str, tool_names=None) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, calls): the content is ``text`` itself when there are no calls, else the text
    around them (None when there is none)."""
    stream = fmt.stream(tool_names)
    pieces = stream.feed(text) + stream.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    if not calls:
        return text, []
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, calls
