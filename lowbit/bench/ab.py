"""`lowbit bench ab`: two shell commands run interleaved (A B, B A, A B, ...), a number
parsed from each run's output, and a difference stated only beyond the spread.

Verdict rule: a difference is stated when the two samples' min..max ranges do not overlap;
otherwise "no difference beyond spread". With R rounds each side has R values.
"""

from __future__ import annotations

import re
import subprocess
import time

from lowbit.bench.record import md_table
from lowbit.bench.stats import spread
from lowbit.errors import LowbitError

DEFAULT_METRIC = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*tok/s"


def parse_metric(text: str, pattern: str = DEFAULT_METRIC) -> float | None:
    """The last match of pattern in text: its first group, else the whole match, as a float."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    m = matches[-1]
    raw = m.group(1) if m.groups() else m.group(0)
    num = re.search(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", raw)
    return float(num.group(0)) if num else None


def run_once(cmd: str, pattern: str, timeout: float | None) -> tuple[float, float]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise LowbitError(f"command failed with exit code {p.returncode}: {cmd}\n{p.stderr[-500:]}")
    value = parse_metric(p.stdout + "\n" + p.stderr, pattern)
    if value is None:
        raise LowbitError(f"no number matching {pattern!r} in the output of: {cmd}; "
                          "pass --metric REGEX with one group around the number")
    return value, wall


def run_ab(cmd_a: str, cmd_b: str, rounds: int, pattern: str = DEFAULT_METRIC,
           timeout: float | None = None, log=print) -> dict:
    if rounds < 1:
        raise LowbitError("--rounds must be at least 1")
    re.compile(pattern)
    per_round = []
    for i in range(rounds):
        order = "AB" if i % 2 == 0 else "BA"
        got = {}
        for side in order:
            got[side], got[side + "_wall"] = run_once(cmd_a if side == "A" else cmd_b, pattern, timeout)
        per_round.append({"round": i + 1, "order": order, "A": got["A"], "B": got["B"],
                          "A_wall_s": got["A_wall"], "B_wall_s": got["B_wall"]})
        log(f"round {i + 1} ({' '.join(order)}): A {got['A']:g}  B {got['B']:g}")
    a = [r["A"] for r in per_round]
    b = [r["B"] for r in per_round]
    return {"kind": "ab", "command_a": cmd_a, "command_b": cmd_b, "metric": pattern,
            "rounds": per_round, "A": spread(a), "B": spread(b), "verdict": verdict(a, b)}


def verdict(a: list[float], b: list[float]) -> str:
    sa, sb = spread(a), spread(b)
    rel = (sb["median"] - sa["median"]) / abs(sa["median"]) * 100 if sa["median"] else float("inf")
    if sb["min"] > sa["max"] or sa["min"] > sb["max"]:
        hi, lo = ("B", "A") if sb["median"] > sa["median"] else ("A", "B")
        return (f"{hi} is higher than {lo}: median B/A {rel:+.1f}%, beyond the spread "
                "(the min-max ranges do not overlap)")
    return f"no difference beyond spread (median B/A {rel:+.1f}%, the min-max ranges overlap)"


def format_report(rec: dict) -> str:
    rows = [[r["round"], " ".join(r["order"]), f"{r['A']:g}", f"{r['B']:g}"] for r in rec["rounds"]]
    stat = lambda s: [f"{s['median']:g}", f"{s['min']:g}-{s['max']:g}", f"{s['iqr']:g}"]
    summary = md_table(["side", "median", "min-max", "IQR"],
                       [["A", *stat(rec["A"])], ["B", *stat(rec["B"])]])
    return (f"A: `{rec['command_a']}`  \nB: `{rec['command_b']}`\n\n"
            + md_table(["round", "order", "A", "B"], rows) + "\n\n" + summary
            + f"\n\nVerdict: {rec['verdict']}")
