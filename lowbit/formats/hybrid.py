"""An expert stack held in two formats: HybridTensor, the container a hybrid quantization
(lowbit.quantize.policy.HybridSpec) leaves on an Experts module.

One path from a stored payload to what a kernel reads:
  QuantizedTensor (payload; here one per part) -> LutView / Fp8View / VqWeight / DenseWeight
  (lowbit.formats.views) -> lowbit.kernels.weights.resolve() -> LutWeight (the kernel's
  decode decisions); lowbit.kernels.moe_layout.layout_of stacks the parts' LutWeights into
  the layout the hybrid MoE kernels read.

Shape legend: E experts of the layer, Eh / Ec experts of the hot / cold part, N rows, K
columns. Invariant: every expert sits in exactly one part; all parts share N and K.
Pure torch: nothing here imports lowbit.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError


class HybridTensor:
    """An expert stack [E, N, K] held in two formats: parts {"hot": QuantizedTensor [Eh, N, K],
    "cold": QuantizedTensor [Ec, N, K]} and members {part: layer expert ids, in stack order}.
    What an Experts module holds after a hybrid quantization (lowbit.quantize.policy.HybridSpec);
    the artifact stores each part's payload under `<parameter>.<part>.<payload name>`."""

    def __init__(self, shape: tuple[int, ...], parts: dict, members: dict[str, list[int]]):
        self.shape = tuple(int(s) for s in shape)
        self.parts, self.members = dict(parts), {k: list(v) for k, v in members.items()}
        self.format = _HybridName("hybrid(" + ",".join(f"{k}={q.format.name}" for k, q in self.parts.items()) + ")")
        ids = sorted(i for m in self.members.values() for i in m)
        if ids != list(range(self.shape[0])) or set(self.parts) != set(self.members):
            raise LowbitError(f"hybrid stack {list(self.shape)}: every expert must sit in exactly one part.")
        for k, q in self.parts.items():
            if tuple(q.shape) != (len(self.members[k]), *self.shape[1:]):
                raise LowbitError(f"hybrid part {k} is {list(q.shape)}, expected {len(self.members[k])} experts.")
        self._layout: tuple | None = None  # (w2, kernel layout): kept by lowbit.kernels.moe_layout.layout_of

    def _where(self, e: int) -> tuple[str, int]:
        for k, m in self.members.items():
            if e in m:
                return k, m.index(e)
        raise LowbitError(f"expert index {e} is out of range for {self.shape[0]} experts.")

    def __getitem__(self, e: int):
        part, local = self._where(int(e))
        return self.parts[part][local]

    def __len__(self) -> int:
        return self.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([self[e].dequantize(dtype) for e in range(self.shape[0])])

    def to(self, device) -> HybridTensor:
        return HybridTensor(self.shape, {k: q.to(device) for k, q in self.parts.items()}, self.members)

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.parts.values())

    @property
    def bits_per_weight(self) -> float:
        n = 1
        for s in self.shape:
            n *= s
        return self.nbytes * 8 / n


@dataclass
class _HybridName:
    name: str
