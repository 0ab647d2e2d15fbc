"""Lossless acceptance of draft tokens: which drafts a verify step keeps, and the token after.

Shapes: B sequences, K drafts at most per sequence (K1 = K + 1 positions), V vocabulary.
  tokens, num_accepted = accept(logits, drafts, num_drafts, state, rows, steps, mode, draft_probs)
  logits       [B, K1, V] float32  target logits at the last real token and at each draft
  drafts       [B, K] int64        padded past num_drafts[b] [B] int64
  draft_probs  [B, K, V] or None   the distribution each draft was drawn from; rows whose
                                   `sampled_drafts[b]` is False (and every row when None) drafted
                                   point masses (n-gram lookup, a greedy drafter)
  tokens       [B, K1] int64       accepted drafts, then the token after them at index
                                   num_accepted[b] [B]; entries past it are meaningless
Position j of row b is the token at index steps[b] + j of the sequence. The target's
distribution there is the sampler's own (lowbit.kernels.sample_op): penalties over the
output tokens plus drafts[:j] (they precede it if it is reached at all), temperature,
top-k / top-p / min-p; greedy rows are a point mass on the argmax.

The rule (Leviathan et al. 2023; Chen et al. 2023): accept draft d_j drawn from q_j with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
norm(max(p_j - q_j, 0)); when every draft is accepted draw the bonus token from p_K1. The
tokens are then distributed exactly as the target's own samples.
For point-mass drafts the rule is run through the target's own draw: t_j = the token a decode
step would sample at that index (argmax(p_j / noise), noise from the row's seed and step),
d_j is accepted iff t_j == d_j, and the first t_j that differs is the correction. That is the
rule above with q = delta(d): P(t_j = d) = p_j(d) = min(1, p_j(d) / 1), and given t_j != d,
t_j follows p_j restricted to tokens != d, which is norm(max(p_j - delta(d), 0)). It is also
the very token a run without speculation draws, so greedy and seeded outputs are the same
with and without point-mass drafts. Sampled drafts (a draft model or MTP at temperature > 0)
use u_j < p_j(d_j) / q_j(d_j) with u_j uniform from the row's seed and step on a stream of
its own, and the residual draw with the step's noise: the same distribution, not the same
draw as without speculation; still the same tokens on every run and in any batch.

No host read and fixed shapes for fixed B, K: a verify step can be captured in a graph; the
host reads `tokens` and `num_accepted` once, after it.

Synthetic acceptance (`lowbit bench latency --spec-synthetic-accept P` only): `forced`
[B, K] bool replaces the rule's verdicts, so a bench at random weights, where no draft
would be accepted, can time verify steps at a chosen acceptance. The token after the run
is still the target's own draw at that position; the text is not the target's.
"""

from __future__ import annotations

import torch

from lowbit.kernels.sample_op import SampleMode, apply_penalties, exponential_noise, filter_logits

UNIFORM_STREAM = 0x5BD1E995  # xor-ed into a row's seed: the acceptance uniforms' stream
DRAFT_STREAM = 0x27D4EB2F  # the stream a sampled draft is drawn with


def target_probs(logits: torch.Tensor, state, rows: torch.Tensor, filters: bool) -> torch.Tensor:
    """The sampler's distribution of random rows: logits [N, V] -> probabilities [N, V]
    (the same operations, in the same order, as the `sample` op's torch route)."""
    t = state.temperature[rows]
    if filters:
        return filter_logits(logits, t, state.top_k[rows], state.top_p[rows], state.min_p[rows])
    return (logits / t.clamp(min=1e-5)[:, None]).softmax(-1)


def race(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(p / noise): a draw from probs [N, V] with the counter-based noise of (seed, step)."""
    return (probs / exponential_noise(seeds, steps, probs.shape[-1])).argmax(-1)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N] uniforms in (0, 1) from (seed, step) on the acceptance stream: exp(-Exp(1))."""
    return exponential_noise(seeds ^ UNIFORM_STREAM, steps, 1)[:, 0].neg().exp()


def draft_tokens(logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor,
                 mode: SampleMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's tokens [N] and the distribution they were drawn from ([N, V], None when
    every row is greedy): argmax for greedy rows (their q is a point mass), else a draw from
    the draft logits under the row's temperature and filters, on the draft stream."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    if not mode.random:
        return greedy, None
    q = target_probs(logits, state, rows, mode.filters)
    drawn = race(q, state.seed[rows] ^ DRAFT_STREAM, steps)
    return torch.where(state.temperature[rows] == 0, greedy, drawn), q


def _penalized(logits: torch.Tensor, state, rows: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Penalties at every position, counting the drafts before it: logits [B, K1, V]."""
    B, K1, V = logits.shape
    seen = torch.zeros(B, K1, V, dtype=torch.int32, device=logits.device)
    if K1 > 1:
        onehot = torch.nn.functional.one_hot(drafts, V).to(torch.int32)  # [B, K, V]
        seen[:, 1:] = onehot.cumsum(1)
    counts = (state.counts[rows][:, None] + seen).view(B * K1, V)
    mask = state.prompt_mask[rows][:, None].expand(B, K1, V).reshape(B * K1, V)
    rep = lambda name: getattr(state, name)[rows].repeat_interleave(K1)
    out = apply_penalties(logits.view(B * K1, V), counts, mask, rep("repetition_penalty"),
                          rep("presence_penalty"), rep("frequency_penalty"))
    return out.view(B, K1, V)


def accept(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, state,
           rows: torch.Tensor, steps: torch.Tensor, mode: SampleMode,
           draft_probs: torch.Tensor | None = None, sampled_drafts: torch.Tensor | None = None,
           forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's rule; returns (tokens [B, K1], num_accepted [B])."""
    B, K1, V = logits.shape
    K, dev = K1 - 1, logits.device
    rows = rows.long()
    logits = logits.float()
    if mode.penalties:
        logits = _penalized(logits, state, rows, drafts)
    flat = logits.view(B * K1, V)
    rows_f = rows.repeat_interleave(K1)  # [B * K1]
    steps_f = (steps.long()[:, None] + torch.arange(K1, device=dev)).view(-1)
    t = flat.argmax(-1)  # [B * K1]
    probs = None
    if mode.random:
        probs = target_probs(flat, state, rows_f, mode.filters)  # [B * K1, V]
        drawn = race(probs, state.seed[rows_f], steps_f)
        t = torch.where(state.temperature[rows_f] == 0, t, drawn)
    t = t.view(B, K1)
    valid = torch.arange(K, device=dev)[None, :] < num_drafts[:, None]  # [B, K]
    ok = t[:, :K] == drafts  # [B, K]
    after = t
    if draft_probs is not None and probs is not None and K:
        use = valid if sampled_drafts is None else valid & sampled_drafts[:, None]
        ok, after = _sampled_rule(probs.view(B, K1, V), t, drafts, draft_probs, ok, use, state, rows_f, steps_f)
    if forced is not None:
        ok = forced
    num_accepted = (ok & valid).long().cumprod(-1).sum(-1)  # [B]
    tokens = torch.cat((drafts, drafts.new_zeros(B, 1)), dim=1)
    tokens.scatter_(1, num_accepted[:, None], after.gather(1, num_accepted[:, None]))
    if mode.penalties:
        _count(state, rows, tokens, num_accepted)
    return tokens, num_accepted


def _sampled_rule(probs: torch.Tensor, t: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor,
                  ok: torch.Tensor, use: torch.Tensor, state, rows_f: torch.Tensor,
                  steps_f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions `use` [B, K] (sampled drafts of random rows): acceptance by u q(d) <= p(d)
    and residual draws. probs [B, K1, V], t [B, K1] the target's own draws, q [B, K, V]."""
    B, K1, V = probs.shape
    K = K1 - 1
    p = probs[:, :K]  # [B, K, V]
    pd = p.gather(-1, drafts[..., None])[..., 0]  # [B, K]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    head = torch.arange(B * K1, device=probs.device).view(B, K1)[:, :K].reshape(-1)
    u = uniforms(state.seed[rows_f[head]], steps_f[head]).view(B, K)
    residual = (p - q).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q: a rejection can only be rounding
    residual = torch.where(empty, p, residual).view(B * K, V)
    redraw = race(residual, state.seed[rows_f[head]], steps_f[head]).view(B, K)
    use = use & (state.temperature[rows_f[head]] != 0).view(B, K)
    ok = torch.where(use, u * qd <= pd, ok)
    after = t.clone()
    after[:, :K] = torch.where(use, redraw, t[:, :K])
    return ok, after


def _count(state, rows: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """counts[rows[b], tokens[b, j]] += 1 for j <= num_accepted[b] (the tokens emitted)."""
    B, K1 = tokens.shape
    V = state.counts.shape[1]
    emitted = (torch.arange(K1, device=tokens.device)[None, :] <= num_accepted[:, None])
    flat = state.counts.view(-1)
    index = (rows[:, None] * V + tokens).view(-1)
    flat.index_add_(0, index, emitted.view(-1).to(flat.dtype))
