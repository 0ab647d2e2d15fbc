"""AsyncLLMEngine: the LLMEngine behind an asyncio front, for the server.

One background thread owns the engine: it loads the model, then loops — apply the queued
commands (add, abort), run one `step()`, hand each RequestDelta to its request's asyncio
queue through the event loop. Nothing else touches the engine's scheduler, so adds and
aborts need no locks, and an abort lands before the next step (its blocks free within
one step). `submit` validates synchronously (bad requests fail before any work), checks
the bounded queue, and returns a RequestStream; closing a stream that has not finished
aborts its request. If a step raises, the engine is dead: every stream gets the error
and new submissions are refused. `drain` is the shutdown: refuse new requests, let the
running ones finish for a while, then abort the rest so that each stream still receives
its last delta (finish_reason "abort").
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from lowbit.engine.engine import LLMEngine
from lowbit.engine.request import RequestDelta
from lowbit.engine.sampling import SamplingParams
from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

LOADING_RETRY_AFTER = 5  # seconds: models load in seconds to minutes
DRAINING_RETRY_AFTER = 1
ABORT_GRACE = 5.0  # seconds the handlers of aborted requests get to send their last chunk


class EngineUnavailable(LowbitError):
    """The engine is loading, shutting down, or dead (HTTP 503); `retry_after` is set, in
    seconds, when a retry can succeed (loading, draining), and None when it cannot."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(LowbitError):
    """Too many requests are already waiting (HTTP 429)."""


class RequestStream:
    """The deltas of one request, as an async iterator; `close()` aborts it if unfinished."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        self.owner._forget(self.request_id, abort=not self.finished)
        self.finished = True


class AsyncLLMEngine:
    def __init__(self, engine_factory: Callable[[], LLMEngine], max_queued_requests: int) -> None:
        self._factory = engine_factory
        self.max_queued_requests = max_queued_requests
        self.engine: LLMEngine | None = None
        self.error: BaseException | None = None
        self.accepting = True
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._lock = threading.Lock()  # guards _streams between the loop and the engine thread
        self._thread = threading.Thread(target=self._run, name="lowbit-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.error is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- the front: called on the event loop ----------------------------------------------------
    def check_available(self) -> LLMEngine:
        if self.error is not None:
            raise EngineUnavailable(f"the engine stopped after an error: {self.error}")
        if not self.accepting:
            raise EngineUnavailable("the server is shutting down; retry on another replica or "
                                    "after it restarts", retry_after=DRAINING_RETRY_AFTER)
        if not self.is_ready:
            raise EngineUnavailable("the model is still loading; retry shortly", retry_after=LOADING_RETRY_AFTER)
        return self.engine

    def submit(self, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> list[RequestStream]:
        """Queue requests (id, prompt ids, params, prompt text) all or none; return their streams."""
        engine = self.check_available()
        for _, ids, params, _ in requests:
            engine.check_request(ids, params)
        capacity = engine.config.max_num_seqs + self.max_queued_requests
        if self.num_in_flight + len(requests) > capacity:
            raise QueueFull(f"{self.num_in_flight} requests are in flight and the server takes at most "
                            f"{capacity}; retry later")
        loop = asyncio.get_running_loop()
        streams = []
        for request_id, ids, params, prompt in requests:
            stream = RequestStream(self, request_id)
            with self._lock:
                self._streams[request_id] = (loop, stream)
            self._commands.put(("add", request_id, ids, params, prompt))
            streams.append(stream)
        return streams

    def _forget(self, request_id: str, abort: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if abort:
            self._commands.put(("abort", request_id))

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give in-flight ones `timeout` seconds to finish, then abort
        the rest and wait until their handlers have taken the abort delta."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        await self._wait_streams(loop.time() + timeout)
        if self._streams and self.error is None and self._thread.is_alive():
            log.info("aborting %d requests still running after %.0f s", len(self._streams), timeout)
            with self._lock:
                ids = list(self._streams)
            for request_id in ids:
                # keep the stream: the abort delta must still reach it
                self._commands.put(("abort", request_id))
            await self._wait_streams(loop.time() + ABORT_GRACE)

    async def _wait_streams(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def shutdown(self, timeout: float) -> None:
        """Drain, drop what is left (handlers that never took their last delta), stop."""
        await self.drain(timeout)
        for request_id in list(self._streams):
            self._forget(request_id, abort=True)
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join, max(timeout, ABORT_GRACE))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
            # the model, its routes and the tokenizer are hundreds of thousands of objects that
            # live as long as the process: out of the collector's reach, a full collection
            # while serving no longer walks them (135 ms for the demo engine's heap on the CPU)
            gc.collect()
            gc.freeze()
            while self._apply_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    for delta in self.engine.step():
                        self._deliver(delta.request_id, delta)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; streams learn why
            log.exception("engine loop failed")
            self.fail(e)

    def fail(self, error: BaseException) -> None:
        """The engine is dead (from any thread; the first error stays): /health answers 503,
        new requests are refused, every open stream gets the error."""
        if self.error is None:
            self.error = error
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self._deliver(request_id, EngineUnavailable(f"the engine failed: {error}"))

    def _apply_commands(self, block: bool) -> bool:
        """Run queued adds and aborts; False once asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd[0] == "stop":
                return False
            if cmd[0] == "abort":
                self.engine.abort(cmd[1])
                continue
            _, request_id, ids, params, prompt = cmd
            if request_id not in self._streams:
                continue  # closed before it was added
            try:
                self.engine.add_request(ids, params, request_id=request_id, prompt=prompt)
            except LowbitError as e:
                self._deliver(request_id, e)

    def _deliver(self, request_id: str, item: RequestDelta | BaseException) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, stream = entry
        try:
            loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
            self._forget(request_id, abort=False)
