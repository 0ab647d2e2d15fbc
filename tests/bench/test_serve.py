import json
from pathlib import Path

import pytest

from lowbit.bench.client import normalize_base_url, parse_prometheus
from lowbit.cli import main
from tests.bench.fake_openai import FakeServer, FakeState


def _run(url: str, tmp_path: Path, *extra: str) -> dict:
    rc = main(["bench", "serve", "--base-url", url, "--input-len", "12", "--output-len", "9",
               "--records", str(tmp_path), *extra])
    assert rc == 0
    (path,) = tmp_path.glob("*serve*.json")
    return json.loads(path.read_text())


def _max_overlap(reqs: list[dict]) -> int:
    events = sorted([(r["send"], 1) for r in reqs] + [(r["end"], -1) for r in reqs], key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def _check_level(lv: dict, state: FakeState) -> None:
    s = lv["summary"]
    reqs = lv["requests"]
    assert s["failed"] == 0 and s["completed"] == lv["num_prompts"] == len(reqs)
    # token counts match what the server sent for this level (its counter's delta)
    assert s["total_output_tokens"] == lv["metrics_delta"]["fake_generated_tokens_total"] == 9 * len(reqs)
    for r in reqs:
        assert r["completion_tokens"] == 9 and len(r["chunks"]) == 9
        times = [r["send"], r["first"], *r["chunks"], r["end"]]
        assert times == sorted(times) and r["first"] == r["chunks"][0]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "per_user_tok_s"):
        d = s[key]
        assert 0 < d["min"] <= d["median"] <= d["p99"] <= d["max"], key
        assert d["min"] <= d["mean"] <= d["max"], key
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["aggregate_throughput"] == pytest.approx(s["output_throughput"])
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration_s"])
    assert s["total_token_throughput"] == pytest.approx(
        (s["total_input_tokens"] + s["total_output_tokens"]) / s["duration_s"])
    # the wall interval covers every request and is no longer than the sum of them
    assert max(r["end"] for r in reqs) <= s["duration_s"] + 1e-3
    # the server cannot stream faster than its own pacing (robust to a busy client)
    for r in reqs:
        assert r["chunks"][-1] - r["send"] >= 0.95 * (state.ttft_s + 8 * state.itl_s)
    # the per-user rate is each request's (tokens - 1) over its first-to-last chunk span
    rates = sorted(8 / (r["chunks"][-1] - r["first"]) for r in reqs)
    assert s["per_user_tok_s"]["min"] == pytest.approx(rates[0], rel=1e-3)
    assert s["per_user_tok_s"]["max"] == pytest.approx(rates[-1], rel=1e-3)
    assert _max_overlap(reqs) == lv["concurrency"]


def test_serve_levels_against_fake_server(tmp_path, capsys):
    state = FakeState()
    with FakeServer(state) as srv:
        rec = _run(srv.url + "/v1", tmp_path, "--concurrency", "1,4", "--num-prompts", "8",
                   "--context", "0,40")
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "P99 ITL (ms):" in out and "Per-user decode rate" in out
    assert rec["kind"] == "serve" and rec["model"] == "fake-model" and rec["prompt_mode"] == "ids"
    assert rec["env"]["command"].startswith("lowbit bench serve") or rec["env"]["command"]
    assert [(lv["context"], lv["concurrency"]) for lv in rec["levels"]] == [(0, 1), (0, 4), (40, 1), (40, 4)]
    for lv in rec["levels"]:
        _check_level(lv, state)
        # id prompts have exact lengths: the retained prefix plus the request's own tokens
        assert all(r["prompt_tokens"] == lv["context"] + 12 for r in lv["requests"])
    assert state.peak_inflight == 4
    assert rec["server_metrics"]["before"]["fake_requests_total"] < rec["server_metrics"]["after"]["fake_requests_total"]


def test_serve_counts_chunks_without_usage_or_tokenizer(tmp_path):
    state = FakeState(usage=False, tokenize=False, itl_s=0.002)
    with FakeServer(state) as srv:
        rec = _run(srv.url, tmp_path, "--concurrency", "3", "--num-prompts", "6",
                   "--endpoint", "/v1/chat/completions", "--payload", "stochastic")
    (lv,) = rec["levels"]
    assert rec["prompt_mode"] == "words" and not lv["summary"]["usage_reported"]
    _check_level(lv, state)


def test_serve_reports_failed_requests(tmp_path, capsys):
    state = FakeState(fail_every=3, ttft_s=0.0, itl_s=0.001)
    with FakeServer(state) as srv:
        rec = _run(srv.url, tmp_path, "--concurrency", "2", "--num-prompts", "9", "--warmup", "0")
    s = rec["levels"][0]["summary"]
    assert s["failed"] >= 2 and s["completed"] + s["failed"] == 9
    assert s["total_output_tokens"] == 9 * s["completed"]
    assert any("HTTP 500" in e for e in s["errors"])
    assert "Failed requests:" in capsys.readouterr().out


def test_serve_falls_back_to_ids_without_tokenizer_and_stops_at_time_limit(tmp_path):
    state = FakeState(tokenize=False, accept_text=False, ttft_s=0.0, itl_s=0.02)
    with FakeServer(state) as srv:
        rec = _run(srv.url, tmp_path, "--concurrency", "1,2", "--num-prompts", "4", "--time-limit", "0.5")
    assert rec["prompt_mode"] == "ids"
    (lv,) = rec["levels"]  # 4 requests of ~0.16 s each: the deadline passes during the first level
    assert lv["concurrency"] == 1 and 1 <= lv["summary"]["completed"] == lv["num_prompts"] < 4
    assert lv["summary"]["failed"] == 0
    assert rec["skipped"] == [{"concurrency": 2, "context": 0}]


def test_unreachable_server_says_so(tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--records", str(tmp_path)])
    assert rc == 2 and "cannot reach" in capsys.readouterr().err


def test_helpers():
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    m = parse_prometheus('# c\na_total 3\nb{x="1 2"} 4.5 1700000000\nbad line x\n')
    assert m == {"a_total": 3.0, 'b{x="1 2"}': 4.5}


def test_token_chunks_exclude_role_and_finish_only_events():
    from lowbit.bench.client import _is_token_chunk

    chat = lambda delta, fin=None: {"choices": [{"delta": delta, "finish_reason": fin}]}
    text = lambda t, fin=None, lp=None: {"choices": [{"text": t, "finish_reason": fin, "logprobs": lp}]}
    assert [_is_token_chunk(e) for e in (
        chat({"role": "assistant"}), chat({"content": "a"}), chat({}, "stop"),
        chat({"content": ""}, "length"), chat({"content": "z"}, "stop"),
        text("a"), text(""), text("", "stop"), text("", "stop", {"tokens": ["x"]}),
        {"choices": []}, {"usage": {"completion_tokens": 3}},
    )] == [False, True, False, False, True, True, True, False, True, False, False]


def test_serve_runs_without_ignore_eos_where_the_server_refuses_it(tmp_path, capsys):
    state = FakeState(strict_fields=True, ttft_s=0.0, itl_s=0.001)
    with FakeServer(state) as srv:
        rec = _run(srv.url, tmp_path, "--concurrency", "2", "--num-prompts", "4", "--ignore-eos")
    s = rec["levels"][0]["summary"]
    assert rec["dropped_fields"] == ["ignore_eos"] and not rec["config"]["ignore_eos"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 4 * 9
    assert "refuses ignore_eos" in capsys.readouterr().out


def test_warm_up_sends_a_round_per_concurrency_level_before_measuring(tmp_path):
    state = FakeState(ttft_s=0.0, itl_s=0.0)
    with FakeServer(state) as srv:
        rec = _run(srv.url, tmp_path, "--concurrency", "1,3", "--num-prompts", "4", "--warmup", "2")
    assert sum(lv["num_prompts"] for lv in rec["levels"]) == 8
    # two unrecorded rounds of C requests per level with 4 output tokens, then the 8 measured
    # ones with 9 (one more request probes the server's extensions first)
    assert state.sent_per_request.count(4) == 2 * (1 + 3) and state.sent_per_request.count(9) == 8
    assert state.sent_per_request[-8:] == [9] * 8
