"""The route registry: for each hot op, ordered implementations and the rule that picks one.

A route is a name, a status, the record that justifies the status (a docs/BENCHMARKS.md
anchor, or the measured number for a negative), `admit(call) -> None | reason` and
`run(call)`. Selection for one call of op OP:
  1. env LOWBIT_ROUTE_<OP>=<name> forces that route; a name that is not registered
     raises LowbitError listing the valid ones, and a forced route that refuses the call
     raises LowbitError with its reason (fail closed: nothing silently runs instead).
     The value "auto" (or an empty value) means no forcing.
  2. otherwise the first DEFAULT route, in registration order, that admits the call.
The torch reference route of every op admits everything and is registered last, so
step 2 always finds one. OPT_IN and MEASURED_NEGATIVE routes run only when forced.

Counters: calls per (op, layer, route) and refusals per (op, layer, route, reason), read by
`route_table()` (the `lowbit routes` printout) and `counters()` (/metrics). Under CUDA
graph capture the Python side runs once, so counts are per captured call, not per replay.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lowbit.errors import LowbitError

log = logging.getLogger("lowbit")

DEFAULT = "DEFAULT"
OPT_IN = "OPT_IN"
MEASURED_NEGATIVE = "MEASURED_NEGATIVE"
STATUSES = (DEFAULT, OPT_IN, MEASURED_NEGATIVE)
ENV_PREFIX = "LOWBIT_ROUTE_"
# The ops lowbit.kernels registers, known ahead so that a forcing variable for one is not
# mistaken for a typo before its module is imported.
KNOWN_OPS = ("linear", "moe", "attention", "latent_attention", "kv_write", "norm", "norm_gate", "rope",
             "rope_attention", "mla_rope", "act", "router", "sample")


@dataclass
class Route:
    name: str
    status: str
    record: str
    admit: Callable[[Any], str | None]
    run: Callable[[Any], Any]

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise AssertionError(f"route {self.name}: status {self.status} not in {STATUSES}")
        if not self.record:
            raise AssertionError(f"route {self.name}: every status cites a record")


@dataclass
class Op:
    name: str
    routes: list[Route] = field(default_factory=list)

    def names(self) -> list[str]:
        return [r.name for r in self.routes]

    def get(self, name: str) -> Route:
        for r in self.routes:
            if r.name == name:
                return r
        raise LowbitError(
            f"{ENV_PREFIX}{self.name.upper()}={name!r} names no {self.name} route; "
            f"valid names: {', '.join(self.names())} (or auto)."
        )

    def prefer(self, name: str) -> None:
        """Make route `name` the first choice of the calls it admits (an A/B, in-process):
        DEFAULT status, and the DEFAULT routes ahead of it in selection order set to OPT_IN.
        The caller restores the statuses."""
        route = self.get(name)
        for r in self.routes[:self.routes.index(route)]:
            if r.status == DEFAULT:
                r.status = OPT_IN
        route.status = DEFAULT


_OPS: dict[str, Op] = {}
_CALLS: Counter = Counter()  # (op, layer, route) -> calls
_REFUSALS: Counter = Counter()  # (op, layer, route, reason) -> refusals
_LOCK = threading.Lock()


def register(op: str, route: Route, *, reference: bool = False, slow: bool = True) -> Route:
    """Add a route to op (created on first use). The reference route must come last.
    slow=False: a reference that is itself the fast path (a fused op whose reference runs
    the unfused ops by their own routes), so falling back to it on CUDA warns of nothing."""
    entry = _OPS.setdefault(op, Op(op))
    if route.name in entry.names():
        raise AssertionError(f"route {op}/{route.name} registered twice")
    if entry.routes and _is_reference(entry.routes[-1]):
        raise AssertionError(f"{op}: the reference route {entry.routes[-1].name} must stay last")
    route.reference = reference  # type: ignore[attr-defined]
    route.slow = slow  # type: ignore[attr-defined]
    entry.routes.append(route)
    return route


def _is_reference(route: Route) -> bool:
    return bool(getattr(route, "reference", False))


def ops() -> dict[str, Op]:
    return dict(_OPS)


def forced_name(op: str) -> str | None:
    """The route name LOWBIT_ROUTE_<OP> forces, or None. Strict: see module docstring."""
    raw = os.environ.get(ENV_PREFIX + op.upper())
    if raw is None or raw.strip() in ("", "auto"):
        return None
    name = raw.strip()
    if op in _OPS:
        _OPS[op].get(name)  # raises on a misspelt name
    return name


def check_env(environ: dict[str, str] | None = None) -> None:
    """Raise LowbitError for any LOWBIT_ROUTE_* variable that names no known op or route."""
    env = os.environ if environ is None else environ
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        op = key[len(ENV_PREFIX) :].lower()
        if op not in KNOWN_OPS and op not in _OPS:
            raise LowbitError(
                f"{key} names no op; known ops: {', '.join(sorted(set(KNOWN_OPS) | set(_OPS)))}."
            )
        if op in _OPS and value.strip() not in ("", "auto"):
            _OPS[op].get(value.strip())


def select(op: str, call: Any, layer: str = "") -> Route:
    """The route that runs this call (see module docstring), counting refusals under layer."""
    entry = _OPS[op]
    forced = forced_name(op)
    if forced is not None:
        route = entry.get(forced)
        call.forced = True
        reason = route.admit(call)
        if reason is not None:
            raise LowbitError(
                f"{ENV_PREFIX}{op.upper()}={forced} forces a route that refuses this call: "
                f"{reason}. Unset the variable or pick another route ({', '.join(entry.names())})."
            )
        return route
    call.forced = False
    refused = []
    for route in entry.routes:
        if route.status != DEFAULT:
            continue
        reason = route.admit(call)
        if reason is None:
            if refused and _is_reference(route) and _on_cuda(call) and getattr(route, "slow", True):
                _warn_fallback(op, route.name, refused)
            return route
        refused.append((route.name, reason))
        with _LOCK:
            _REFUSALS[(op, layer, route.name, reason)] += 1
    raise AssertionError(f"{op}: no DEFAULT route admitted the call; the reference must")


def _on_cuda(call: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in vars(call).values())


_WARNED: set = set()
_PROBE = threading.local()


@contextlib.contextmanager
def start_up_probe(what: str):
    """Calls inside are a start-up probe (the engine's memory-profile forward, which has no
    KV pool yet), not serving: a fallback there is logged at INFO, left out of
    `warned_fallbacks()` and does not use up the WARNING a serving call would print."""
    previous, _PROBE.what = getattr(_PROBE, "what", None), what
    try:
        yield
    finally:
        _PROBE.what = previous


def _warn_fallback(op: str, reference: str, refused: list[tuple[str, str]]) -> None:
    """A CUDA call that every fast route refused runs the reference: slow, so say it once
    per (op, reasons) at WARNING (stderr), not only in the counters."""
    key = (op, tuple(refused))
    probe = getattr(_PROBE, "what", None)
    if probe is not None:
        log.info("%s (%s) runs its %s reference route: %s", op, probe, reference,
                 "; ".join(f"{name}: {reason}" for name, reason in refused))
        return
    if key in _WARNED:
        return
    _WARNED.add(key)
    why = "; ".join(f"{name}: {reason}" for name, reason in refused)
    log.warning("%s runs its %s reference route on CUDA (slow): %s", op, reference, why)


def warned_fallbacks() -> list[str]:
    """The fallbacks warned about so far, one line each (bench records carry them)."""
    return sorted(f"{op}: " + "; ".join(f"{n}: {r}" for n, r in refused) for op, refused in _WARNED)


def dispatch(op: str, call: Any, layer: str = "") -> Any:
    """Select a route for call, count it under layer, run it."""
    route = select(op, call, layer)
    with _LOCK:
        _CALLS[(op, layer, route.name)] += 1
    return route.run(call)


def route_table() -> list[dict[str, Any]]:
    """One row per route: op, route, status, record, calls, refusals (for `lowbit routes`)."""
    rows = []
    for op in _OPS.values():
        for r in op.routes:
            calls = sum(n for (o, _l, name), n in _CALLS.items() if o == op.name and name == r.name)
            refused = sum(n for (o, _l, name, _why), n in _REFUSALS.items()
                          if o == op.name and name == r.name)
            rows.append({"op": op.name, "route": r.name, "status": r.status, "record": r.record,
                         "calls": calls, "refusals": refused})
    return rows


def format_table(rows: list[dict[str, Any]] | None = None) -> str:
    """route_table() as aligned text."""
    rows = route_table() if rows is None else rows
    cols = ("op", "route", "status", "calls", "refusals", "record")
    width = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def counters() -> dict[str, list[dict[str, Any]]]:
    """Counts for /metrics: route calls by (op, layer, route), refusals by (op, layer, route,
    reason)."""
    with _LOCK:
        calls = [{"op": o, "layer": la, "route": r, "count": n} for (o, la, r), n in _CALLS.items()]
        refusals = [{"op": o, "layer": la, "route": r, "reason": why, "count": n}
                    for (o, la, r, why), n in _REFUSALS.items()]
    return {"route_calls": calls, "route_refusals": refusals}


def reset_counters() -> None:
    with _LOCK:
        _CALLS.clear()
        _REFUSALS.clear()
