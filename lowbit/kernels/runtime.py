"""Where Triton kernels can run: triton importable, a CUDA device, or the interpreter.

TRITON_INTERPRET=1 runs Triton kernels on CPU tensors (tests). There, a Triton route
admits CPU tensors only when forced, so that auto selection on a CPU keeps the torch
reference (the interpreter is far slower than torch on the CPU).
"""

from __future__ import annotations

import functools
import os

import torch

from lowbit.formats.views import Fp8View, LutWeight


class _NoTriton:
    """Stands in for `triton` and `triton.language` where triton is not installed (it is a
    test dependency; a CPU install runs the torch routes). Kernel modules still import, so
    their torch twins work; `@triton.jit` gives a kernel that refuses to launch, and every
    route's admission already refuses with "triton is not installed" first."""

    def __getattr__(self, name: str) -> _NoTriton:  # tl.constexpr, tl.float16, triton.language
        return self

    def jit(self, fn=None, **_kw):
        return _UnlaunchableKernel(fn) if fn is not None else _UnlaunchableKernel

    def __call__(self, *args, **kwargs):
        raise RuntimeError("triton is not installed; this needs a Triton kernel")


class _UnlaunchableKernel:
    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(f"triton is not installed: kernel {self.fn.__name__} cannot launch")


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = tl = _NoTriton()
    HAS_TRITON = False


def _patch_interpreter_index() -> None:
    """numpy >= 2.3 refuses int() of a 1-element array, which triton 3.6's interpreter does
    for every runtime loop bound (`range(0, K, BK)`); read the element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "lowbit_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.lowbit_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if HAS_TRITON:
    _patch_interpreter_index()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_refusal(t: torch.Tensor, forced: bool) -> str | None:
    """Why a Triton kernel cannot take tensor t here, or None."""
    if not HAS_TRITON:
        return "triton is not installed"
    if t.is_cuda:
        return "the Triton interpreter is on (TRITON_INTERPRET=1)" if interpreting() else None
    if interpreting() and forced:
        return None
    return f"tensors on {t.device.type} (Triton kernels need CUDA, or TRITON_INTERPRET=1 and a forced route)"


def round_for_dot(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to dtype the way the running Triton backend converts float32 before tl.dot,
    returned as float32: round-to-nearest-even on the GPU; triton 3.6's interpreter
    truncates float32 -> bf16 (it keeps the top 16 bits), so the twins mirror that there."""
    if dtype == torch.bfloat16 and interpreting():
        return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
    return t.to(dtype).float()


@functools.cache
def capability(index: int = 0) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index) if torch.cuda.is_available() else (0, 0)


@functools.cache
def sm_count(index: int = 0) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4


@functools.cache
def device_name(index: int = 0) -> str:
    return torch.cuda.get_device_name(index) if torch.cuda.is_available() else "cpu"


def uses_fp8(w) -> bool:
    """Whether a resolved weight's decode reads float8_e4m3 values (fp8 codes, or LUT codes
    under e4m3 block scales as in nvfp4)."""
    return isinstance(w, Fp8View) or (isinstance(w, LutWeight) and w.view.scale_kind == "e4m3")


def fp8_refusal(t: torch.Tensor, *weights) -> str | None:
    """Triton converts float8_e4m3 only on compute capability 8.9+ (Ada, Hopper)."""
    if t.is_cuda and any(uses_fp8(w) for w in weights) and capability(t.device.index or 0) < (8, 9):
        return "float8_e4m3 weights or scales need compute capability 8.9 or newer in Triton"
    return None


_SEMAPHORES: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # counters replaced by larger ones, kept alive (below)


def semaphore(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 split-K counters on device, all zero between launches (each launch
    resets the ones it used). A larger request gets a new tensor; the old one stays alive,
    because CUDA graphs captured earlier keep its address and would otherwise replay into
    freed memory."""
    sem = _SEMAPHORES.get(device)
    if sem is None or sem.numel() < n:
        if sem is not None:
            _OUTGROWN.append(sem)
        sem = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _SEMAPHORES[device] = sem
    return sem
