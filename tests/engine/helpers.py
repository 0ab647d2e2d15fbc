"""Running an engine to completion in tests."""

from __future__ import annotations

from lowbit.engine.engine import LLMEngine
from lowbit.engine.request import RequestDelta


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestDelta]]:
    """Step until idle; every request's deltas, in order."""
    deltas: dict[str, list[RequestDelta]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return deltas
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    raise AssertionError("the engine did not finish")


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[RequestDelta]) -> str:
    return "".join(d.text for d in deltas)
