"""Server fixtures: real uvicorn servers on 127.0.0.1 (a free port), in a thread of the
test process so tests can also look at the engine behind them."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from lowbit.config import EngineConfig
from lowbit.server.launch import GracefulServer, build, uvicorn_config
from tests.engine.tiny_model import make_tiny_model


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll until `cond()` holds; the deadline is a failure, never the expected path."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class RunningServer:
    def __init__(self, config: EngineConfig) -> None:
        self.app, self.async_engine = build(config)
        self.server = GracefulServer(uvicorn_config(self.app, config), self.async_engine, config.shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: self.async_engine.is_ready, what="the model to load")
        wait_for(lambda: self.app.state.lowbit.startup is not None, what="the startup report")
        self.api_key = config.api_key

    @property
    def engine(self):
        return self.async_engine.engine

    def http(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, **{"timeout": 60, **kw})

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0)

    def metrics(self) -> tuple[dict[str, str], dict[str, list[tuple[str, float]]]]:
        """/metrics as ({metric: type}, {sample name: [(series with labels, value)]})."""
        with self.http() as h:
            text = h.get("/metrics").text
        types, samples = {}, {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                types[name] = kind
            elif line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                samples.setdefault(series.split("{")[0], []).append((series, float(value)))
        return types, samples

    def wait_idle(self) -> None:
        blocks = self.engine.blocks
        wait_for(lambda: not self.engine.has_unfinished() and self.async_engine.num_in_flight == 0
                 and blocks.num_free_blocks == blocks.num_total_blocks, what="the engine to go idle")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(autouse=True, scope="module")
def _single_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe_server"))


SERVER_DEFAULTS = dict(host="127.0.0.1", port=0, kv_cache_tokens=4096, max_num_seqs=8,
                       max_queued_requests=8, max_request_body_bytes=1 << 20, served_model_name="tiny",
                       shutdown_timeout=5.0)


@pytest.fixture(scope="module")
def server(tiny_model):
    s = RunningServer(EngineConfig(model=str(tiny_model), **SERVER_DEFAULTS))
    yield s
    s.stop()


@pytest.fixture
def start_server(tiny_model):
    started = []

    def start(**overrides) -> RunningServer:
        s = RunningServer(EngineConfig(model=str(tiny_model), **{**SERVER_DEFAULTS, **overrides}))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
