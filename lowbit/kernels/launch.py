"""Launch configs: JSON files under lowbit/kernels/configs/, keyed by device, shape and M.

File layout (one file per device, `configs/<device slug>.json`, plus `configs/default.json`
for any device and shape):
  {"device": "NVIDIA H200",
   "<kernel>": {"<fmt>:<N>x<K>": {"<M bucket>": {config}}, "default": {"<M bucket>": {config}}}}
M buckets are powers of two; a call takes the smallest bucket >= M (else the largest).
A device file may also hold "choice": {"<fmt>:<N>x<K>": {"<M bucket>": "gemv" | "gemm"}},
the faster of the two linear kernels as `scripts/tune_kernels.py` measured it.
Lookup order: device file exact shape, device default, default.json exact shape,
default.json default. `scripts/tune_kernels.py` writes device files.

LOWBIT_LAUNCH_CONFIGS=<path> names an overlay in the same layout (a tuner's output, such as
`scripts/tune_tc_gemv.py`'s tc_tuned.json), looked up before the device file. It is read at
every call, so `bench latency --variant tuned=LOWBIT_LAUNCH_CONFIGS:<path>` times a tuner's
configs in the engine, beside the shipped ones, before they are merged into a device file.

A device with no file of its own may borrow a tuned sibling's (`configs/aliases.json`:
device slug -> the slug whose file it reads, for GPUs of the same die and SM count, e.g. the
H100 SXM and the H200: GH100, 132 SMs, their HBM differs). `config_status` says which file
serves a device, for the bench record; a device with neither runs the defaults, with a
WARNING once (an untuned device picks per-slot MoE kernels where the tuned files pick the
expert-grouped ones, 0.6x the throughput at 32 and 64 sequences on an H100).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.kernels.runtime import device_name, interpreting

CONFIG_DIR = Path(__file__).parent / "configs"
OVERLAY_ENV = "LOWBIT_LAUNCH_CONFIGS"
log = logging.getLogger("lowbit")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@functools.cache
def _file(name: str) -> dict:
    path = CONFIG_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def overlay_file(path: str) -> dict:
    """An overlay's tables; a missing or malformed file is an error, not the shipped configs."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise LowbitError(f"{OVERLAY_ENV}={path}: not a readable JSON launch-config file ({e})") from e
    if not isinstance(table, dict) or not any(isinstance(v, dict) for k, v in table.items() if k != "device"):
        raise LowbitError(f"{OVERLAY_ENV}={path}: no kernel tables (expected {{\"<kernel>\": "
                          "{\"<fmt>:<N>x<K>\": {\"<M bucket>\": {config}}}})")
    kernels = sorted(k for k, v in table.items() if isinstance(v, dict) and k != "choice")
    log.warning("%s=%s: its launch configs (%s) come before the shipped ones", OVERLAY_ENV, path,
                ", ".join(kernels) or "choices only")
    here = device_name() if torch.cuda.is_available() else None
    if table.get("device") and here and slug(table["device"]) != slug(here):
        log.warning("%s=%s was tuned on %s; this device is %s", OVERLAY_ENV, path, table["device"], here)
    return table


def _overlay() -> dict:
    path = os.environ.get(OVERLAY_ENV)
    return overlay_file(path) if path else {}


@functools.cache
def _device_file(name: str) -> str | None:
    """The config file (slug) a device reads: its own, an alias's, or None (defaults only)."""
    if _file(name):
        return name
    alias = _file("aliases").get(name)
    if alias and _file(alias):
        return alias
    if name != "cpu":
        log.warning("launch configs: no tuned file for %s (lowbit/kernels/configs); kernels run their default "
                    "configs, which can be much slower (scripts/gpu_check.sh stages tune, tunemoe, tunetc write one)",
                    name)
    return None


def _device(device: str | None) -> dict:
    name = _device_file(slug(device or device_name()))
    return {} if name is None else _file(name)


def config_status(device: str | None = None) -> str:
    """Which tuned file serves the device, for the bench record's footer."""
    own = slug(device or device_name())
    name = _device_file(own)
    extra = f", under the overlay {os.environ[OVERLAY_ENV]}" if os.environ.get(OVERLAY_ENV) else ""
    if name is None:
        return f"launch configs: NONE tuned for {own} (defaults; can be much slower){extra}"
    return (f"launch configs: {name}.json" + ("" if name == own else f" (borrowed by {own}: same die and SM count)")
            + extra)


def _pick(buckets: dict, m: int) -> dict | None:
    if not buckets:
        return None
    keys = sorted(int(b) for b in buckets)
    for b in keys:
        if b >= m:
            return dict(buckets[str(b)])
    return dict(buckets[str(keys[-1])])


def lookup(kernel: str, fmt: str | tuple[str, ...], n: int, k: int, m: int,
           device: str | None = None) -> dict:
    """The launch config of kernel for a weight [n, k] in fmt and m rows of activations. fmt
    may be a tuple, most specific first (("lut4-e2m1-e4m3-16", "lut4")): the first tuned
    entry for the shape wins, then the table's default."""
    files = (_overlay(), _device(device), _file("default"))
    fmts = (fmt,) if isinstance(fmt, str) else fmt
    for f in files:
        table = f.get(kernel, {})
        for key in (*(f"{x}:{n}x{k}" for x in fmts), "default"):
            if key in table:
                cfg = _pick(table[key], m)
                if cfg is not None:
                    return cfg
    raise AssertionError(f"configs/default.json has no default for kernel {kernel}")


def choice(fmt: str, n: int, k: int, m: int, device: str | None = None) -> str | None:
    """"gemv" or "gemm": the kernel measured faster for a weight [n, k] in fmt at m rows
    (the device file's "choice" table, exact shapes only, M buckets as for configs), or
    None where this device and shape were not measured."""
    key = f"{fmt}:{n}x{k}"
    buckets = _overlay().get("choice", {}).get(key) or _device(device).get("choice", {}).get(key)
    if not buckets:
        return None
    keys = sorted(int(b) for b in buckets)
    return buckets[str(next((b for b in keys if b >= m), keys[-1]))]


def clear_cache() -> None:
    _file.cache_clear()
    _device_file.cache_clear()
    overlay_file.cache_clear()
    _pdl_status.cache_clear()


_RECORDER: list | None = None

# -- programmatic dependent launch ------------------------------------------------------------
# On sm_90+, a kernel launched with the PDL attribute may start while the kernel before it
# in the stream is still running; CUDA graphs keep that as a programmatic edge. Every kernel
# that takes a `PDL` constexpr follows one protocol (pdl_enter in lowbit.kernels.pdl):
# before `griddepcontrol.wait` it may only compute addresses and load memory no earlier
# kernel writes (weights, norm gains, code tables); after the wait it signals
# `griddepcontrol.launch_dependents` and does everything else. So a kernel's reads of
# activations and all of its writes happen after every earlier kernel has completed, the
# next kernel can launch and fetch its weights while this one runs, and at most two
# kernels of a chain overlap. LOWBIT_PDL=0 turns it off (A/B runs).


@functools.cache
def _pdl_status(index: int) -> str:
    if os.environ.get("LOWBIT_PDL", "1") == "0":
        return "off: LOWBIT_PDL=0"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"off: sm_{major}{minor} has no programmatic dependent launch (sm_90+)"
    return f"on (sm_{major}{minor})"


def pdl_status(device: torch.device | str | None = None) -> str:
    """"on (sm_90)" or "off: <reason>" for kernels launched on device."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or interpreting():
        return f"off: not a CUDA launch ({device.type})"
    return _pdl_status(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(t: torch.Tensor) -> dict:
    """Launch kwargs for a kernel with a `PDL` constexpr whose tensors live with t."""
    on = t.is_cuda and not interpreting() and pdl_status(t.device).startswith("on")
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def run(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), or record the launch while `recording()` is active
    (scripts/tune_kernels.py --static compiles the recorded launches for a GPU offline)."""
    if _RECORDER is not None:
        _RECORDER.append((kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def recording():
    """Collect launches instead of running them; yields the list."""
    global _RECORDER
    previous, _RECORDER = _RECORDER, []
    try:
        yield _RECORDER
    finally:
        _RECORDER = previous
