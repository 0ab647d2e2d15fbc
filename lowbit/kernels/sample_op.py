"""The `sample` op: next tokens from logits, reading every parameter from device tensors.

Shape legend: B rows of the batch, V vocabulary, R rows of the sampler state.
  tokens = sample_rows(logits, state, rows, steps, mode)   # [B, V] float32 -> [B] int64
Row b reads its request's parameters at state row rows[b] (int64 [B], on the device):
  state.temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty
        [R] float32;  state.top_k [R] int32 (0: off);  state.seed [R] int64;
  state.counts [R, V] int32 (output-token counts) and state.prompt_mask [R, V] bool, read
        and advanced only in penalties mode (lowbit.engine.sampling.SamplingState).
The step: penalties (mode.penalties); greedy rows (temperature 0) take the argmax; random
rows divide by the temperature, apply top-k / top-p / min-p (mode.filters) and draw
argmax(p / noise), noise ~ Exp(1) from a counter-based hash of (seed, steps[b], token id):
a seeded row draws the same token whatever batch, position or padding it sits in. Then
counts[rows[b], token] += 1 (mode.penalties). No host read and fixed shapes for a fixed B,
so a decode CUDA graph captures it; the mode is static per graph.

Routes (the random draw differs; penalties, filters and greedy rows are the same torch code):
  triton_race   OPT-IN: noise and argmax(p / noise) fused in one kernel over V split across
                programs (reads the logits once); filters still sort in torch.
The uniforms are the same bits on every device and route; -log(u) may round differently in
the last place (CUDA's log is not the CPU's), so a near-tie can break either way across them.
  torch         reference (admits every call; graph-safe): the noise as [B, V] int64 tensors
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels import routes
from lowbit.kernels.runtime import sm_count, tl, triton, triton_refusal

RECORD = ("no record yet: promotion waits for an engine-level record with random sampling "
          "(docs/BENCHMARKS.md#decode-graph)")

# splitmix64 (Steele, Lea, Flood 2014) constants as signed int64: torch has no uint64 math,
# and int64 multiply and add wrap modulo 2^64 on CPU and CUDA.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_UNIFORM_BITS = 24  # float32 holds them exactly: u = (k + 0.5) / 2^24 lies in (0, 1)


@dataclass(frozen=True)
class SampleMode:
    """Static flags of a batch's sampler work (one CUDA graph per mode and bucket).
    random: some row has temperature > 0 (else: argmax only); filters: some random row has
    top-k / top-p / min-p on (a sort over V); penalties: some row has a penalty."""

    random: bool = False
    filters: bool = False
    penalties: bool = False

    def __str__(self) -> str:
        on = [name for name in ("random", "filters", "penalties") if getattr(self, name)]
        return "+".join(on) or "greedy"


GREEDY = SampleMode()


@dataclass
class SampleCall:
    logits: torch.Tensor  # [B, V] float32
    state: object  # SamplingState: the [R] and [R, V] tensors of the module docstring
    rows: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64
    mode: SampleMode
    forced: bool = False


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; counts [B, V] output-token counts; prompt_mask [B, V] bool.
    rep/pres/freq [B]. Repetition penalty (CTRL-style) covers prompt and output tokens.
    A row with rep 1, pres 0, freq 0 comes back unchanged, bit for bit."""
    seen = prompt_mask | (counts > 0)
    r = rep[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - freq[:, None] * counts - pres[:, None] * (counts > 0).float()


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns probabilities [B, V].
    A row with every filter off (top_k <= 0, top_p 1, min_p 0) gets softmax(logits / t)."""
    V = logits.shape[-1]
    logits = logits / temperature.clamp(min=1e-5)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    cum = probs.cumsum(-1) - probs  # mass strictly before each token
    drop |= (cum >= top_p[:, None]) & (top_p < 1)[:, None]  # rounding must not cut top_p = 1
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits).softmax(-1)


def _shr_(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 z, in place: a bijection of 64-bit words that
    scatters every input bit over the output."""
    z ^= _shr_(z, 30)
    z *= _MIX1
    z ^= _shr_(z, 27)
    z *= _MIX2
    z ^= _shr_(z, 31)
    return z


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, V: int) -> torch.Tensor:
    """Exp(1) noise [B, V] float32, a pure function of (seeds[b], steps[b], token id):
    key_b = mix(mix(seed) + step * golden), z = mix(key_b + (v + 1) * golden) (splitmix64's
    stream from key_b), u = (top 24 bits of z + 0.5) / 2^24, noise = -log(u)."""
    key = mix64_(mix64_(seeds.to(torch.int64).clone()) + steps.to(torch.int64) * _GOLDEN)  # [B]
    z = torch.arange(1, V + 1, dtype=torch.int64, device=seeds.device) * _GOLDEN  # [V]
    z = mix64_(z[None, :] + key[:, None])  # [B, V]
    u = _shr_(z, 64 - _UNIFORM_BITS).float().add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)
    return u.log_().neg_()


def _penalized(logits: torch.Tensor, state, rows: torch.Tensor) -> torch.Tensor:
    assert state.counts is not None, "penalties mode needs the state's counts (SamplingState.assign)"
    return apply_penalties(logits, state.counts[rows], state.prompt_mask[rows],
                           state.repetition_penalty[rows], state.presence_penalty[rows],
                           state.frequency_penalty[rows])


def _draw_torch(logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor,
                filters: bool) -> torch.Tensor:
    """Random rows' tokens [B]: p from the temperature (and filters), argmax(p / noise)."""
    t = state.temperature[rows]  # [B]
    if filters:
        probs = filter_logits(logits, t, state.top_k[rows], state.top_p[rows], state.min_p[rows])
    else:
        probs = (logits / t.clamp(min=1e-5)[:, None]).softmax(-1)  # [B, V]
    noise = exponential_noise(state.seed[rows], steps, logits.shape[-1])
    return probs.div_(noise).argmax(-1)


def _count(state, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """counts[rows[b], tokens[b]] += 1 on the device (atomic adds: padded rows repeat)."""
    flat = state.counts.view(-1)
    flat.index_add_(0, rows * state.counts.shape[1] + tokens, torch.ones_like(tokens, dtype=flat.dtype))


def _tokens(call: SampleCall, draw) -> torch.Tensor:
    """The step of the module docstring; draw(logits, state, rows, steps, filters) -> [B]
    is the route's random draw."""
    logits, state, rows, mode = call.logits.float(), call.state, call.rows.long(), call.mode
    if mode.penalties:
        logits = _penalized(logits, state, rows)
    tokens = logits.argmax(-1)  # [B] int64
    if mode.random:
        drawn = draw(logits, state, rows, call.steps.long(), mode.filters)
        tokens = torch.where(state.temperature[rows] == 0, tokens, drawn)
    if mode.penalties:
        _count(state, rows, tokens)
    return tokens


# -- the Triton draw --------------------------------------------------------------------------
@triton.jit
def _mix(z):
    """splitmix64's finalizer on uint64 (mix64_'s twin)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _race_kernel(x_ptr, t_ptr, seed_ptr, step_ptr, best_ptr, idx_ptr, V, chunk, stride_x,
                 NSPLIT: tl.constexpr, BLOCK: tl.constexpr, PROBS: tl.constexpr):
    """Program (b, s) scans tokens [s * chunk, (s + 1) * chunk) of row b and writes the best
    race key and its lowest token id to best/idx [B, NSPLIT]. Key: p / noise (PROBS: x holds
    probabilities) or x / t - log(noise) (x holds logits; the same argmax as softmax(x / t)
    / noise). noise = exponential_noise's value for (seed[b], step[b], token)."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    seed = tl.load(seed_ptr + b).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + b).to(tl.uint64, bitcast=True)
    key = _mix(_mix(seed) + step * 0x9E3779B97F4A7C15)
    inv_t = 1.0 / tl.maximum(tl.load(t_ptr + b), 1e-5)
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32) + s * chunk
    end = tl.minimum(s * chunk + chunk, V)
    for off in range(s * chunk, end, BLOCK):
        v = off + lane
        m = v < end
        x = tl.load(x_ptr + b.to(tl.int64) * stride_x + v, mask=m, other=0.0)
        z = _mix(key + (v + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        u = ((z >> 40).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
        noise = -tl.log(u)
        k = x / noise if PROBS else x * inv_t - tl.log(noise)
        k = tl.where(m, k, float("-inf"))
        better = k > best  # strict: each lane keeps its lowest token among equal keys
        best = tl.where(better, k, best)
        best_i = tl.where(better, v, best_i)
    top = tl.max(best, 0)
    tl.store(best_ptr + b * NSPLIT + s, top)
    tl.store(idx_ptr + b * NSPLIT + s, tl.min(tl.where(best == top, best_i, V), 0))


RACE_BLOCK = 1024


def race_argmax(x: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor, probs: bool) -> torch.Tensor:
    """[B] int64: argmax over V of the race key (see _race_kernel) of x [B, V] float32, with
    temperature [B] float32 (logits only), seeds and steps [B] int64. V is split over enough
    programs to fill the device; torch picks the best split (lowest token among ties)."""
    B, V = x.shape
    nsplit = max(1, min(triton.cdiv(V, RACE_BLOCK), triton.cdiv(2 * sm_count(x.device.index or 0), B)))
    chunk = triton.cdiv(triton.cdiv(V, nsplit), RACE_BLOCK) * RACE_BLOCK
    nsplit = triton.cdiv(V, chunk)
    best = torch.empty(B, nsplit, dtype=torch.float32, device=x.device)
    idx = torch.empty(B, nsplit, dtype=torch.int32, device=x.device)
    _race_kernel[(B, nsplit)](x, temperature, seeds, steps, best, idx, V, chunk, x.stride(0),
                              NSPLIT=nsplit, BLOCK=RACE_BLOCK, PROBS=probs, num_warps=4)
    return idx.gather(1, best.argmax(-1, keepdim=True))[:, 0].long()


def _draw_triton(logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor,
                 filters: bool) -> torch.Tensor:
    t, seeds = state.temperature[rows], state.seed[rows]
    if filters:
        probs = filter_logits(logits, t, state.top_k[rows], state.top_p[rows], state.min_p[rows])
        return race_argmax(probs, t, seeds, steps, probs=True)
    return race_argmax(logits.contiguous(), t, seeds, steps, probs=False)


def _admit_triton(call: SampleCall) -> str | None:
    reason = triton_refusal(call.logits, call.forced)
    if reason is not None:
        return reason
    if call.logits.dim() != 2 or call.logits.shape[0] == 0:
        return f"logits of shape {tuple(call.logits.shape)} (the kernel takes [B >= 1, V])"
    return None


routes.register("sample", routes.Route(
    "triton_race", routes.OPT_IN, RECORD, _admit_triton, lambda call: _tokens(call, _draw_triton)))
routes.register("sample", routes.Route(
    "torch", routes.DEFAULT, "reference (admits every call; no host read, graph-safe)",
    lambda call: None, lambda call: _tokens(call, _draw_torch)), reference=True)


def sample_rows(logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor,
                mode: SampleMode, *, layer: str = "") -> torch.Tensor:
    """logits [B, V] -> tokens [B] int64 on the logits' device (module docstring)."""
    return routes.dispatch("sample", SampleCall(logits, state, rows, steps, mode), layer)
