"""The one background thread that owns the :class:`~hybrid.Engine`; every HTTP connection feeds it.

The engine is not thread-safe, so nothing else touches it: HTTP handlers (on the asyncio event
loop) send *commands* (add these requests, abort those, stop) through a queue, and the loop
thread runs them between engine steps. Requests of all connections therefore join one running
batch (continuous batching across clients). Each step's new tokens go back to their own
connection's asyncio queue at once (``call_soon_threadsafe``), so every stream advances per step.

An abort (a client that went away) is applied before the next step, so its KV blocks and state
slot are free within one step. A step that raises fails the requests in flight with an error
event and aborts them; the loop itself keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .logprobs import TokenLogprobs, score_tokens
from .metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("hybrid.server")


def engine_usage(engine) -> EngineSnapshot:
    """Requests and cache in use, read from the engine's internals. The ONE place that reads them:
    repoint this when the engine's scheduler / cache manager move them."""
    kv, ssm = engine.cache.kv, engine.cache.ssm
    report = engine.cache.report()
    return EngineSnapshot(
        running=len(engine.running), waiting=len(engine.waiting),
        kv_blocks_total=kv.num_blocks, kv_blocks_in_use=kv.num_blocks - kv.allocator.num_free,
        state_slots_total=ssm.num_slots, state_slots_in_use=ssm.num_slots - ssm.num_free,
        cache_bytes_total=report.bytes_total, cache_bytes_in_use=report.bytes_in_use)


@dataclass
class Choice:
    """One engine request: a prompt, how to sample it (None: ``max_tokens=0``, nothing generated),
    and the log-probabilities wanted once it finishes (``logprobs`` alternatives per position;
    ``echo`` includes the prompt's positions)."""

    prompt: list[int]
    params: SamplingParams | None
    logprobs: int | None = None
    echo: bool = False
    priority: int = 0  # lower is scheduled first (the request's ``priority``)


@dataclass
class TokenEvent:
    index: int  # the choice
    token_ids: list[int]
    text: str


@dataclass
class FinalEvent:
    index: int
    token_ids: list[int]  # the last step's ids (streams send them before finishing)
    text: str  # the last step's text
    output_ids: list[int]  # every generated id
    output_text: str
    finish_reason: str
    logprobs: TokenLogprobs | None = None


@dataclass
class ErrorEvent:
    message: str


class LoopClosed(RuntimeError):
    """The engine loop stopped before it could take the request."""


class RequestGroup:
    """The choices of one HTTP request and the asyncio queue their events arrive on."""

    def __init__(self, choices: list[Choice], aio_loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.aio_loop = aio_loop
        self.request_ids: list[int] = []  # engine ids, set by the loop thread

    def push(self, event) -> None:
        deliver(self.aio_loop, [(self, event)])


def deliver(aio_loop: asyncio.AbstractEventLoop, items: list[tuple[RequestGroup, object]]) -> None:
    """Hand events to their groups' queues on the event loop, in one wake-up for all of them."""
    def put_all():
        for group, event in items:
            group.events.put_nowait(event)
    try:
        aio_loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the event loop has closed (shutdown); nobody is listening
        pass


@dataclass
class _Track:
    group: RequestGroup
    index: int
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass
class AbortRecord:
    """When an abort was asked and when it took effect, counted in engine steps."""

    request_ids: list[int]
    step_asked: int
    step_applied: int


@dataclass
class LoopStats:
    steps: int = 0
    aborts: list[AbortRecord] = field(default_factory=list)
    step_errors: int = 0


class EngineLoop:
    """Run ``engine`` in a background thread; :meth:`submit` and :meth:`abort` from any thread."""

    def __init__(self, engine, *, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.stats = LoopStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[int, _Track] = {}
        self._stopping: float | None = None  # the deadline for in-flight requests once stop() was called
        self._thread = threading.Thread(target=self._run, name="hybrid-engine-loop", daemon=True)
        self._publish()

    # ---- from other threads ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread, between steps; a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        run.future = fut  # failed with LoopClosed if the loop ends before running it
        self._commands.put(run)
        if self._thread.ident is not None and not self._thread.is_alive():
            self._close()  # the loop has already ended: nobody else will ever take it
        return fut

    def submit(self, group: RequestGroup) -> concurrent.futures.Future:
        """Queue every choice of ``group`` (all or none: a choice the engine refuses, e.g. one the
        cache can never hold, raises its ValueError and none of the group runs)."""
        return self.call(lambda engine: self._add(group))

    def abort(self, group: RequestGroup) -> None:
        """Abort what is left of ``group`` before the next step (idempotent)."""
        asked = self.stats.steps
        self._commands.put(lambda: self._abort(group, asked))

    def stop(self, timeout: float = 10.0) -> None:
        """Let in-flight requests finish for up to ``timeout`` seconds, abort the rest, end the thread."""
        if not self._thread.is_alive():
            return
        self._commands.put(lambda: setattr(self, "_stopping", time.perf_counter() + timeout))
        self._thread.join(timeout + 30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            self._drain(block=not busy and self._stopping is None)
            if self._stopping is not None and (not self.engine.has_unfinished()
                                               or time.perf_counter() > self._stopping):
                self._abort_all("abort")
                self._publish()
                self._close()
                return
            if self.engine.has_unfinished():
                self._step()
            self._publish()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                cmd()
            except Exception:  # noqa: BLE001 - a failed abort must not end the loop
                log.error("engine-loop command failed:\n%s", traceback.format_exc())
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _close(self) -> None:
        """Refuse what was queued after the loop's last look (a submit racing the shutdown)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            fut = getattr(cmd, "future", None)
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(LoopClosed("the engine loop has stopped (the server is shutting down)"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the server
            self.stats.step_errors += 1
            log.error("engine step failed; aborting the requests in flight:\n%s", traceback.format_exc())
            self._abort_all("error", message=f"engine step failed: {type(e).__name__}: {e}")
            return
        self.stats.steps += 1
        self.metrics.engine_steps.inc()
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up per event loop per step
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            if out.new_token_ids:
                if track.first_token_at is None:
                    self._observe_queue_time(out.request_id, track)
                self._observe_tokens(track, len(out.new_token_ids), now)
            if out.finished:
                event = self._finish(out.request_id, track, out.new_token_ids, out.text, out.finish_reason, now)
            else:
                event = TokenEvent(track.index, list(out.new_token_ids), out.text)
            batches.setdefault(track.group.aio_loop, []).append((track.group, event))
        for aio_loop, items in batches.items():
            deliver(aio_loop, items)

    def _observe_queue_time(self, rid: int, track: _Track) -> None:
        req = self.engine.requests.get(rid)
        if req is not None and req.first_scheduled_time is not None:
            self.metrics.queue_time.observe(max(0.0, req.first_scheduled_time - track.group.arrival))

    def _observe_tokens(self, track: _Track, n: int, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(n)
        if track.first_token_at is None:
            track.first_token_at = now
            m.ttft.observe(now - track.group.arrival)
        else:
            m.itl.observe(now - track.last_token_at)
        track.last_token_at = now

    def _finish(self, rid: int, track: _Track, last_ids, last_text, reason: str, now: float) -> FinalEvent:
        req = self.engine.forget(rid)
        del self._tracks[rid]
        choice = track.group.choices[track.index]
        output = list(req.output)
        logprobs = self._score(choice, output)
        self.metrics.finished(reason)
        self.metrics.e2e.observe(now - track.group.arrival)
        return FinalEvent(track.index, list(last_ids), last_text, output, req.text, reason, logprobs)

    def _score(self, choice: Choice, output: list[int]) -> TokenLogprobs | None:
        if choice.logprobs is None:
            return None
        start = 0 if choice.echo else len(choice.prompt)
        if start == len(choice.prompt) + len(output):
            return TokenLogprobs([], [], [])
        return score_tokens(self.engine.model, choice.prompt + output, choice.logprobs, start=start)

    def _add(self, group: RequestGroup) -> list[int]:
        added: list[int] = []
        try:
            for i, choice in enumerate(group.choices):
                if choice.params is not None:
                    rid = self.engine.add_request(choice.prompt, choice.params, priority=choice.priority)
                    added.append(rid)
                    self._tracks[rid] = _Track(group, i)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
                self.engine.forget(rid)
                del self._tracks[rid]
            raise
        group.request_ids = added
        for choice in group.choices:
            self.metrics.prompt_tokens.inc(len(choice.prompt))
        now = time.perf_counter()
        for i, choice in enumerate(group.choices):
            if choice.params is None:  # max_tokens=0: only the prompt (and its log-probabilities)
                self.metrics.finished("length")
                group.push(FinalEvent(i, [], "", [], "", "length", self._score(choice, [])))
                self.metrics.e2e.observe(now - group.arrival)
        return added

    def _abort(self, group: RequestGroup, asked: int) -> None:
        live = [rid for rid in group.request_ids if rid in self._tracks]
        for rid in live:
            self.engine.abort(rid)
            self.engine.forget(rid)
            del self._tracks[rid]
            self.metrics.finished("abort")
        if live:
            self.stats.aborts.append(AbortRecord(live, asked, self.stats.steps))

    def _abort_all(self, reason: str, message: str | None = None) -> None:
        for rid, track in list(self._tracks.items()):
            try:
                self.engine.abort(rid)
                self.engine.forget(rid)
            except Exception:  # noqa: BLE001 - a broken request must not keep the others alive
                log.error("could not abort request %d:\n%s", rid, traceback.format_exc())
            del self._tracks[rid]
            self.metrics.finished(reason)
            if message is not None:
                track.group.push(ErrorEvent(message))
            else:
                track.group.push(FinalEvent(track.index, [], "", [], "", reason))

    def _publish(self) -> None:
        self.metrics.snapshot = engine_usage(self.engine)
