"""The eager decode backend: the model's own packed forward, every layer its torch ops. It takes every step; the
others are faster where they apply."""

from __future__ import annotations

from ..engine.packed_batch import build_batch
from .backend import DecodeBackend


class EagerBackend(DecodeBackend):
    name = "eager"

    def supports(self, model, cache, shape) -> str | None:
        return None

    def run(self, runner, chunks):
        return runner.model.forward_packed(build_batch(runner.manager, chunks), runner.cache)
