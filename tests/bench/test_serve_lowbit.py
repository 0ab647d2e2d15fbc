"""`lowbit bench serve` against the real `lowbit serve` (a subprocess on a free port)."""

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lowbit.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lowbit_server(tiny_moe_dir, tmp_path_factory):
    pytest.importorskip("lowbit.server")
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lowbit", "serve", str(tiny_moe_dir), "--port", str(port),
                                 "--served-model-name", "tiny"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail(f"lowbit serve did not come up:\n{log.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _counter(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith((f"vllm:{name}", f"lowbit:{name}")))


def test_bench_serve_matches_the_server_counters(lowbit_server, tmp_path):
    rc = main(["bench", "serve", "--base-url", lowbit_server, "--concurrency", "2", "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--context", "0,32", "--ignore-eos",
               "--records", str(tmp_path)])
    assert rc == 0
    rec = json.loads(next(tmp_path.glob("*serve*.json")).read_text())
    assert rec["model"] == "tiny" and rec["prompt_mode"] == "ids"
    up = rec["server_startup"]  # the server's own start-up report, kept in the record
    assert 0 < up["time_to_ready_s"] < 120 and up["peak_memory_bytes"] > 0
    assert up["kv_cache_tokens"] >= 32 + 8 + 4 and "measure=" in up["peak_memory_bytes_labels"]
    for lv in rec["levels"]:
        s, delta = lv["summary"], lv["metrics_delta"]
        assert s["completed"] == 4 and s["failed"] == 0 and s["usage_reported"]
        assert s["total_output_tokens"] == 16 == _counter(delta, "generation_tokens_total")
        assert s["total_input_tokens"] == 4 * (lv["context"] + 8) == _counter(delta, "prompt_tokens_total")
        for r in lv["requests"]:
            times = [r["send"], r["first"], *r["chunks"], r["end"]]
            assert times == sorted(times)
        assert 0 < s["ttft_ms"]["median"] <= s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"]
