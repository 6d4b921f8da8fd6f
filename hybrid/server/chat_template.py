"""Chat messages -> prompt text: the checkpoint's own Jinja chat template, else a documented default.

Where the checkpoint folder has a transformers tokenizer (``tokenizer.json`` beside a ``tokenizer_config.json``)
with a chat template and transformers is installed, the tokenizer renders it with its own
``apply_chat_template`` (:class:`TokenizerChatTemplate`): the exact text transformers, vLLM and SGLang give
that model — ``tools``, ``documents``, every special token the tokenizer knows, its template kwargs. Our own
renderer below is the fallback for a folder without a transformers tokenizer (or without transformers).

The fallback's template comes from ``tokenizer_config.json`` (``chat_template``: a string, or a list of
``{"name", "template"}`` of which ``default`` is used) or a ``chat_template.jinja`` file beside
it, and is rendered the way ``transformers`` renders it: a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, the ``tojson`` filter, and the variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``. Its text is tokenized without
adding special tokens (a template writes its own BOS).

Without a template the prompt is ChatML, ``DEFAULT_CHAT_TEMPLATE`` below::

    <|im_start|>system
    You are helpful.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant

and generation also stops at the string ``<|im_end|>`` (``DEFAULT_STOP``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_STOP = ("<|im_end|>",)


class ChatTemplateError(ValueError):
    """A template that does not load or does not render these messages."""


class ChatTemplate:
    def __init__(self, source: str | None = None, *, bos_token: str | None = None, eos_token: str | None = None):
        """``source``: Jinja text, or None for the ChatML default."""
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.is_default = source is None
        self.source = DEFAULT_CHAT_TEMPLATE if source is None else source
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from e

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings the template implies (the default's end-of-turn marker; a checkpoint's own
        template ends turns with its EOS token, which the engine already stops at)."""
        return DEFAULT_STOP if self.is_default else ()

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **extra) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=_messages(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, tools=tools, **extra)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from e


class TokenizerChatTemplate(ChatTemplate):
    """The checkpoint's chat template rendered by its transformers tokenizer's ``apply_chat_template``."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.is_default = False
        self.source = tokenizer.chat_template
        self.bos_token, self.eos_token = tokenizer.bos_token or "", tokenizer.eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **extra) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._tokenizer.apply_chat_template(_messages(messages), tools=tools, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt, **extra)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from e


def _messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as templates read them: text content, and each tool call's JSON ``arguments`` as a
    dict (as transformers' templates expect and vLLM passes them)."""
    out = []
    for m in messages:
        m = {**m, "content": _text_of(m.get("content"))}
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_parsed_call(c) for c in calls]
        out.append(m)
    return out


def _parsed_call(call: dict) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatTemplateError("each tool call needs a function with a name: {'function': {'name': ..., "
                                "'arguments': '<JSON>'}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"tool call {fn['name']!r}: arguments are not JSON ({e})") from None
    return {**call, "function": {**fn, "arguments": args}}


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _text_of(content) -> str:
    """A message's content as text: a string, or OpenAI's list of parts of which only text is read."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"only text content parts are supported, got a part of type {part.get('type')!r}")
        parts.append(part["text"])
    return "".join(parts)


def _token_text(entry) -> str | None:
    return entry.get("content") if isinstance(entry, dict) else entry if isinstance(entry, str) else None


def load_chat_template(checkpoint: str | Path | None) -> ChatTemplate:
    """The checkpoint folder's chat template (a model name stands for its folder; a ``.gguf`` file gives its
    ``tokenizer.chat_template``), or the ChatML default when it has none (or no folder)."""
    if checkpoint is None:
        return ChatTemplate()
    from ..pretrained_names import resolve

    folder = Path(resolve(checkpoint))
    if folder.is_file() and folder.suffix == ".gguf":  # its tokenizer.chat_template metadata
        from ..interop.gguf_tokenizer import tokenizer_folder

        with tokenizer_folder(folder) as files:
            return load_chat_template(files)
    tokenizer = _transformers_tokenizer(folder)
    if tokenizer is not None and tokenizer.chat_template:
        return TokenizerChatTemplate(tokenizer)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if source is None and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    return ChatTemplate(source, bos_token=_token_text(config.get("bos_token")),
                        eos_token=_token_text(config.get("eos_token")))


def _transformers_tokenizer(folder: Path):
    """The folder's transformers fast tokenizer, or None (no tokenizer files there, or no transformers)."""
    if not ((folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    try:  # not AutoTokenizer: it would read the folder's config.json, which is ours
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{folder}: the tokenizer does not load ({e})") from e
