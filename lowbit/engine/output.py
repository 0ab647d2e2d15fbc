"""Turning sampled tokens into text and deciding when a request is done.

`append_token` adds one token: it detokenizes, then checks the stop conditions in vLLM's
order (eos / stop_token_ids, stop strings on the text, max_tokens, the context end).
`take_delta` hands out what is new since the last call. While a request runs, the last
`len(longest stop string) - 1` characters are held back, because they may turn out to be
the start of a stop string that must not reach the client; so the concatenated deltas
always equal the final text.
"""

from __future__ import annotations

from lowbit.engine.request import Request, RequestDelta, TokenLogprob


def find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Earliest index of a stop string that ends in text[new_from:], or None."""
    longest = max(len(s) for s in stops)
    search_from = max(0, new_from - longest + 1)
    hits = [at for s in stops if (at := text.find(s, search_from)) >= 0]
    return min(hits) if hits else None


def append_token(req: Request, token: int, logprob: TokenLogprob | None, eos_ids: set[int],
                 max_model_len: int) -> str | None:
    """Add a sampled token to `req`; return the finish reason if it ends the request."""
    req.token_ids.append(token)
    if logprob is not None:
        req.logprobs.append(logprob)
    p = req.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"  # the stop token's own text is not part of the output
    if req.detokenizer is not None:
        before = len(req.text)
        req.text += req.detokenizer.add(token)
        cut = find_stop(req.text, p.stop, before) if p.stop else None
        if cut is not None:
            req.text = req.text[:cut]
            return "stop"
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def take_delta(req: Request, finish_reason: str | None) -> RequestDelta:
    """What `req` produced since the last delta (text held back near possible stops)."""
    hold = max((len(s) for s in req.params.stop), default=1) - 1 if finish_reason is None else 0
    end = max(req.num_emitted_chars, len(req.text) - hold)
    text = req.text[req.num_emitted_chars:end]
    first = req.num_emitted_tokens == 0
    tokens = req.output_token_ids[req.num_emitted_tokens:]
    logprobs = req.logprobs[req.num_emitted_tokens:] if req.params.logprobs is not None else []
    req.num_emitted_chars, req.num_emitted_tokens = end, req.num_output_tokens
    return RequestDelta(
        request_id=req.request_id, text=text, token_ids=tokens, logprobs=logprobs,
        finish_reason=finish_reason, num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
        prompt_logprobs=req.prompt_logprobs if first and req.wants_prompt_logprobs else None)
