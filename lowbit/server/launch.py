"""`lowbit serve`: build the engine and app, run uvicorn, shut down cleanly on SIGTERM.

The model loads in the engine thread while the server already answers (/health is 503
until it is ready). SIGTERM or SIGINT: stop admitting (new requests get 503 with
Retry-After while the socket still listens), let in-flight requests finish for up to
--shutdown-timeout seconds, abort the rest (each stream ends with a finish_reason "abort"
chunk and [DONE]), close the socket, stop the engine, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading

import uvicorn

from lowbit.config import EngineConfig
from lowbit.distributed import driver, engine_model
from lowbit.distributed.parallel_state import check_launched
from lowbit.engine.async_engine import AsyncLLMEngine
from lowbit.engine.engine import LLMEngine
from lowbit.errors import LowbitError
from lowbit.server.app import create_app

log = logging.getLogger("lowbit")


def server_config(config: EngineConfig) -> EngineConfig:
    """The server's defaults over `config`: --cuda-graph-capture auto means start (no request
    of a server waits for a graph capture)."""
    if config.cuda_graph_capture == "auto":
        return dataclasses.replace(config, cuda_graph_capture="start")
    return config


def build(config: EngineConfig):
    """(app, async engine) for `config`; the engine starts loading when the app starts (under
    tensor / expert parallelism, this rank's shard, driving the other ranks)."""
    config = server_config(config)
    config.validate()
    if config.parallel:  # refused before the server starts, not later in the engine thread
        check_launched(config.tensor_parallel_size, config.expert_parallel_size)
    engine = AsyncLLMEngine(lambda: LLMEngine(config, engine_model(config)), config.max_queued_requests)
    return create_app(config, engine), engine


FLUSH_SECONDS = 5  # after the drain: the time uvicorn gives responses to finish sending


class GracefulServer(uvicorn.Server):
    """uvicorn, except that a handled SIGTERM ends the process with status 0 (uvicorn
    re-raises the signal after its shutdown), first closes the engine's door, and drains
    the engine before uvicorn closes the socket and cancels what still runs."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        self.engine.accepting = False
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self.engine.drain(self.shutdown_timeout))
        while not drain.done() and not self.force_exit:  # a second Ctrl-C stops waiting
            await asyncio.sleep(0.05)
        drain.cancel()
        await super().shutdown(sockets)

    def fail(self, reason: str) -> None:
        """A worker process is gone (tensor / expert parallel): the engine is dead, stop
        serving and exit non-zero."""
        self.engine.fail(LowbitError(f"a worker process failed: {reason}"))
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_config(app, config: EngineConfig) -> uvicorn.Config:
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                          timeout_graceful_shutdown=FLUSH_SECONDS, access_log=False)


def run_server(config: EngineConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app, engine = build(config)
    server = GracefulServer(uvicorn_config(app, config), engine, config.shutdown_timeout)
    driver.on_workers_lost(server.fail)  # only ever called under tensor / expert parallelism
    server.run()
    if engine.error is not None:
        log.error("the engine failed: %s", engine.error)
        return 1
    return 0
