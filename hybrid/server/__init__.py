"""``hybrid serve``: an OpenAI-compatible HTTP server over the :class:`~hybrid.Engine`.

Needs the ``serve`` extra (``pip install "hybrid-lm[serve]"``: fastapi, uvicorn, jinja2).
``create_app(engine, tokenizer, ServerSettings(model_name=...))`` gives the FastAPI app;
``run(app, host, port)`` serves it with uvicorn.
"""

from __future__ import annotations

from .app import ServerSettings, create_app
from .chat_template import ChatTemplate, load_chat_template
from .engine_loop import EngineLoop, engine_usage
from .runner import run

__all__ = ["ChatTemplate", "EngineLoop", "ServerSettings", "create_app", "engine_usage", "load_chat_template", "run"]
