"""Log-probabilities in the two OpenAI shapes: the legacy completions one (parallel lists)
and the chat one (a list of token objects with bytes and top alternatives)."""

from __future__ import annotations

from lowbit.engine.request import TokenLogprob


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, prompt: list[TokenLogprob | None], generated: list[TokenLogprob],
                        prompt_ids: list[int], offset: int = 0) -> dict:
    """`prompt` entries line up with `prompt_ids` (the first is None: nothing predicts it);
    `text_offset` counts from `offset`, the length of the choice's text before these tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    entries = [(tid, lp) for tid, lp in zip(prompt_ids, prompt)] + [(g.token_id, g) for g in generated]
    for tid, lp in entries:
        text = token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {token_text(tokenizer, t): v for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def end_offset(lp: dict, offset: int) -> int:
    """The text offset after the tokens of `lp` (a completion_logprobs result)."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else offset


def chat_logprobs(tokenizer, generated: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(g.token_id, g.logprob), "top_logprobs": [item(t, v) for t, v in g.top]}
                        for g in generated]}
