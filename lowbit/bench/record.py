"""Bench records: one JSON file per run, naming the device, commit, command line and
library versions next to every sample, and the optional Markdown section appended to
docs/BENCHMARKS.md.

A record is a dict: {"kind": "latency" | "serve" | "fingerprint" | "ab" | ..., "created",
"env": environment(), ...the command's own fields}. `lowbit bench report` reads them back.
"""

from __future__ import annotations

import csv
import datetime as dt
import importlib.metadata
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

DEFAULT_DIR = Path("bench/records")
MD_HEADING = "# Benchmarks\n"


def git_commit(cwd: str | Path | None = None) -> str | None:
    """HEAD of the repository lowbit runs from (or cwd), with '+dirty' for a modified tree.
    LOWBIT_COMMIT, when set, wins: a tree copied to another machine without its history
    (a remote GPU run) names the commit it was copied from."""
    if os.environ.get("LOWBIT_COMMIT") and cwd is None:
        return os.environ["LOWBIT_COMMIT"]
    where = cwd or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str | None = None) -> str:
    """'NVIDIA H200' for a CUDA device, the CPU model otherwise."""
    if (device or "").startswith("cuda") or (device is None and torch.cuda.is_available()):
        idx = torch.device(device or "cuda").index or 0
        return torch.cuda.get_device_name(idx)
    return f"cpu: {cpu_name()} ({os.cpu_count()} cores)"


def command_line() -> str:
    """The command as typed: `python -m lowbit ...` and the `lowbit` script both read `lowbit ...`."""
    prog = Path(sys.argv[0]).name
    return shlex.join(["lowbit" if prog in ("lowbit", "__main__.py") else prog, *sys.argv[1:]])


def environment(device: str | None = None) -> dict:
    """Everything a reader needs to place a number: host, device, commit, command, versions."""
    return {
        "device": device_name(device),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "command": command_line(),
        "versions": {n: _version(n) for n in ("lowbit", "torch", "triton", "transformers")},
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "run"


def write_record(record: dict, records_dir: str | Path | None = None, label: str = "") -> Path:
    """Write `record` (kind + fields) with the environment added; return the file path."""
    now = dt.datetime.now(dt.timezone.utc)
    record = {"kind": record["kind"], "created": now.isoformat(timespec="seconds"),
              "env": record.get("env") or environment(), **record}
    out = Path(records_dir or DEFAULT_DIR)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y%m%dT%H%M%S}-{record['kind']}" + (f"-{_slug(label)}" if label else "")
    path = out / f"{stem}.json"
    n = 1
    while path.exists():
        n += 1
        path = out / f"{stem}-{n}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def load_records(records_dir: str | Path) -> list[dict]:
    """Every readable *.json record under records_dir (recursively), oldest first."""
    out = []
    for p in sorted(Path(records_dir).rglob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict):
            rec.setdefault("_path", str(p))
            out.append(rec)
    return out


def append_md(path: str | Path, title: str, body: str, env: dict | None = None) -> None:
    """Append a `## title` section (body + the reproducing command and where it ran);
    create the file with the top heading if absent. Never rewrites what is there."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    lines = [f"\n## {title}", "", body.rstrip(), "",
             f"Command: `{env['command']}`  ", f"Device: {env['device']}; commit "
             f"`{env.get('commit') or 'unknown'}`; torch {env['versions'].get('torch')}.", ""]
    text = "\n".join(lines)
    with p.open("a") as f:
        if f.tell() == 0:
            f.write(MD_HEADING)
        f.write(text)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; numbers are rendered by the caller."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def csv_text(headers: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)
    w.writerows(rows)
    return buf.getvalue()
