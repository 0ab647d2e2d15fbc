"""The startup report: time to ready, peak memory and KV pool size, logged once the
engine is ready and exported in /metrics.

Time to ready counts from the start of the process (Linux: /proc; elsewhere: the import
of this module) to the moment the event loop sees the engine ready, when the server
already listens. Peak memory is torch.cuda.max_memory_allocated on CUDA, and the process
peak RSS on the CPU, where weights, activations and the KV pool share the process memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch

from lowbit.engine.async_engine import AsyncLLMEngine

log = logging.getLogger("lowbit")
_IMPORTED = time.monotonic()


@dataclass
class StartupReport:
    seconds: float  # process start -> ready
    peak_memory_bytes: int
    memory_device: str  # "cuda:0", "cpu"
    memory_measure: str  # "max_memory_allocated" | "peak_rss"
    kv_cache_tokens: int


def process_age() -> float:
    """Seconds since this process started."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, measure): the CUDA allocator's peak, or the process peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss if sys.platform == "darwin" else rss * 1024), "peak_rss"


def report(engine: AsyncLLMEngine) -> StartupReport:
    e = engine.engine
    peak, measure = peak_memory(e.device)
    r = StartupReport(process_age(), peak, str(e.device), measure, e.kv_cache.num_tokens)
    what = "torch.cuda.max_memory_allocated" if measure == "max_memory_allocated" else "process peak RSS"
    log.info("ready in %.1f s; peak memory %.1f MiB (%s, %s); KV cache %d tokens",
             r.seconds, peak / 2**20, what, r.memory_device, r.kv_cache_tokens)
    return r


async def report_when_ready(engine: AsyncLLMEngine) -> StartupReport | None:
    """Wait for the engine to load, then report; None if it failed first."""
    while not engine.is_ready:
        if engine.error is not None:
            return None
        await asyncio.sleep(0.02)
    return report(engine)
