"""`lowbit serve --tensor-parallel-size 2` (and `--expert-parallel-size 2`): rank 0 serves
what one process serves, streams, sizes its KV pool from its own heads, and stops its
worker on SIGTERM (every process exits 0); a worker that dies makes /health answer 503
and the server exit non-zero."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from lowbit.config import EngineConfig
from tests.server.conftest import SERVER_DEFAULTS, RunningServer, wait_for

PROMPT = "It is a truth universally"
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`lowbit serve` in its own session, so the test can see every process it started."""

    def __init__(self, model: Path, *parallel: str) -> None:
        self.port = free_port()
        self._output: str | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "lowbit", "serve", str(model), "--device", "cpu", "--port", str(self.port),
               "--kv-cache-tokens", "4096", "--max-num-seqs", "8", "--served-model-name", "tiny",
               "--shutdown-timeout", "5", *parallel]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        wait_for(lambda: self.health() == 200 or self.proc.poll() is not None, START_TIMEOUT_S, "the server")
        assert self.proc.poll() is None, self.output()

    def health(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return [int(p) for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the server did not exit:\n" + self.output()) from None
        wait_for(lambda: not self.group_alive(), 10, "the workers to exit")
        return self.proc.returncode

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        if self._output is None:
            self._output = self.proc.stdout.read()[-4000:]
        return self._output

    def kill(self) -> None:
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def complete(client: openai.OpenAI, stream: bool = False):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=stream)


@pytest.fixture(scope="module")
def one_process_text(tiny_moe_dir) -> str:
    server = RunningServer(EngineConfig(model=str(tiny_moe_dir), device="cpu", **SERVER_DEFAULTS))
    try:
        return complete(server.client()).choices[0].text
    finally:
        server.stop()


def check_answers(server: ServeProcess, want: str) -> None:
    assert len(server.worker_pids()) == 1
    got = complete(server.client()).choices[0].text
    assert got == want and got
    pieces = [c.choices[0].text for c in complete(server.client(), stream=True)]
    assert len(pieces) > 1 and "".join(pieces) == want


def test_tp2_serves_what_one_process_serves_and_stops_on_sigterm(tiny_moe_dir, one_process_text):
    server = ServeProcess(tiny_moe_dir, "--tensor-parallel-size", "2")
    try:
        check_answers(server, one_process_text)
        # sent to the whole group, as Ctrl-C is: the worker ignores it and follows rank 0
        os.killpg(server.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        assert server.wait(STOP_TIMEOUT_S) == 0, server.output()  # 0: rank 0 and the worker
        assert time.monotonic() - t0 < STOP_TIMEOUT_S
        assert "4096 tokens, float32, 0.5 MiB" in server.output()  # half the heads: half the bytes
    finally:
        server.kill()


def test_ep2_serves_what_one_process_serves_and_fails_when_a_worker_dies(tiny_moe_dir, one_process_text):
    server = ServeProcess(tiny_moe_dir, "--expert-parallel-size", "2")
    try:
        check_answers(server, one_process_text)
        (worker,) = server.worker_pids()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: server.health() != 200, 10, "/health to fail")
        assert server.health() in (503, None)  # 503 until the listener closes
        assert server.wait(STOP_TIMEOUT_S) == 1
        assert "rank 1 exited" in server.output()
    finally:
        server.kill()
