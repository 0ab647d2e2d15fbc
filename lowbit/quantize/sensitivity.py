"""Measured sensitivity for `lowbit quantize --bpw B --sensitivity kl`: how much the model's
next-token distribution moves when one weight alone is replaced by its rounding.

Shape legend: T calibration tokens of the probe (all windows, one flat batch), V vocabulary,
D hidden size.

The probe runs the unquantized model once over the first `tokens` calibration tokens, cut
into windows of `window` tokens that form one batch of independent sequences. It keeps the
model's probabilities p [T, V] and the input (hidden, residual) [T, D] of every decoder
layer (the probabilities as their logs only). Scoring a weight of layer l swaps its dequantized rounding in, reruns layers l..L-1,
the final norm and the logits from the kept inputs, restores the weight, and returns
mean_t KL(p_t || q_t), the KL increase over the unquantized model (whose own KL is 0).
The allocator sums these increases over weights (additive: for small errors KL is
quadratic in them and the cross terms of unrelated weights average out); `kl()` measures
the whole plan once it is installed, to check that sum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lowbit.engine.batch import ForwardBatch
from lowbit.errors import LowbitError
from lowbit.formats import QuantizedTensor

TOKENS = 2048  # calibration tokens the probe scores on
WINDOW = 512  # tokens per sequence of the probe's batch (attention cost is quadratic in it)


@dataclass
class KLProbe:
    """The unquantized model's outputs and per-layer inputs on the probe tokens."""

    model: nn.Module
    x: Tensor  # [T] token ids
    window: int
    batch: ForwardBatch
    logp: Tensor  # [T, V] log-probabilities of the unquantized model
    inputs: list[tuple[Tensor, Tensor | None]]  # per decoder layer, then the final norm: (h, residual)
    layer_of: dict[int, int]  # id(module) -> index of the decoder layer holding it
    seconds: float = 0.0  # spent scoring

    @classmethod
    def build(cls, model: nn.Module, ids: list[int], device: str, tokens: int = TOKENS,
              window: int = WINDOW) -> KLProbe:
        """Score on the first `tokens` of ids (each window needs 2 tokens or more)."""
        ids = ids[:tokens]
        sizes = [len(ids[s:s + window]) for s in range(0, len(ids), window)]
        if not sizes or sizes[-1] < 2:
            sizes = sizes[:-1]
        if not sizes:
            raise LowbitError(f"--sensitivity kl needs at least 2 calibration tokens, the text gives {len(ids)}; "
                              "give more calibration text or use --sensitivity proxy.")
        x = torch.tensor(ids[:sum(sizes)], device=device)
        batch = ForwardBatch.build(sizes, [0] * len(sizes), None, None, torch.device(device))
        layers = model.model.layers
        layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
        probe = cls(model, x, window, batch, torch.empty(0), [], layer_of)
        probe.logp = probe._record()
        return probe

    @torch.inference_mode()
    def _record(self) -> Tensor:
        """Log-probabilities [T, V] of a pass as CausalLM.forward runs it, keeping each layer's input."""
        body = self.model.model
        h, residual = body.embed_tokens(self.x), None
        for layer in body.layers:
            self.inputs.append((h, residual))
            h, residual = layer(h, residual, self.batch)
        self.inputs.append((h, residual))
        return self._head(h, residual)

    @torch.inference_mode()
    def _log_probs(self, start: int) -> Tensor:
        """Log-probabilities [T, V] rerunning decoder layers start.. from their kept inputs."""
        h, residual = self.inputs[start]
        for layer in self.model.model.layers[start:]:
            h, residual = layer(h, residual, self.batch)
        return self._head(h, residual)

    def _head(self, h: Tensor, residual: Tensor | None) -> Tensor:
        hidden = self.model.model.norm.add_norm(h, residual)[0]  # [T, D]
        return torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)

    def _kl(self, logq: Tensor) -> float:
        return float((self.logp.exp() * (self.logp - logq)).sum(-1).clamp_min(0).double().mean())

    def delta_kl(self, mod: nn.Module, attr: str, qt: QuantizedTensor) -> float:
        """KL increase with mod.attr alone replaced by qt's dequantized values."""
        t0 = time.perf_counter()
        param = getattr(mod, attr)
        kept = param.data
        param.data = qt.dequantize(kept.dtype).to(kept.device)
        try:  # a weight outside the decoder layers (lm_head) reruns the head only
            out = self._kl(self._log_probs(self.layer_of.get(id(mod), len(self.inputs) - 1)))
        finally:
            param.data = kept
        self.seconds += time.perf_counter() - t0
        return out

    def kl(self) -> float:
        """KL of the model as it is now (e.g. with a whole plan installed) to the unquantized one."""
        return self._kl(self._log_probs(0))
