"""`LLM`: the offline Python API. Load once, generate for a batch of prompts.

It drives an LLMEngine to completion: every prompt (times `n`) becomes a request, and
`step()` runs until all are finished, so offline generation batches, chunks prefill and
shares prompt prefixes exactly as the server does.
"""

from __future__ import annotations

import dataclasses
import time

from lowbit.checkpoint.loader import LoadedModel
from lowbit.config import EngineConfig
from lowbit.engine.engine import LLMEngine
from lowbit.engine.prompt import PromptEncoder
from lowbit.engine.request import CompletionOutput, RequestDelta, RequestOutput
from lowbit.engine.sampling import SamplingParams
from lowbit.errors import LowbitError

__all__ = ["LLM", "RequestOutput", "CompletionOutput"]


def child_params(sp: SamplingParams, i: int) -> SamplingParams:
    """The i-th of `n` samples: one request each, seeds offset so they differ."""
    seed = None if sp.seed is None else sp.seed + i
    return dataclasses.replace(sp, n=1, seed=seed)


class LLM:
    def __init__(self, model: str = "demo", *, dtype: str = "auto", device: str | None = None,
                 random_weights: bool = False, config: str | None = None,
                 max_model_len: int | None = None, tokenizer: str | None = None,
                 loaded: LoadedModel | None = None, **engine_args) -> None:
        """`loaded`: a model loaded already (lowbit.distributed.engine_model's, under tensor /
        expert parallelism); by default the engine loads `model` itself."""
        cfg = EngineConfig(model=model, dtype=dtype, device=device, random_weights=random_weights,
                           config=config, max_model_len=max_model_len, tokenizer=tokenizer, **engine_args)
        if loaded is None:
            cfg.check_loads_alone()
        self.engine = LLMEngine(cfg, loaded)
        self.device = str(self.engine.device)
        self.loaded = self.engine.loaded
        self.model, self.config = self.engine.model, self.engine.arch
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.eos_ids = self.engine.eos_ids
        self.prompts = PromptEncoder(self.tokenizer) if self.tokenizer is not None else None

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.prompts is None:
                raise LowbitError("this model has no tokenizer; pass token ids instead of text")
            return prompt, self.prompts.encode(prompt)
        return None, [int(t) for t in prompt]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        if self.prompts is None:
            raise LowbitError("this model has no tokenizer, so it has no chat template")
        return self.generate([self.prompts.encode_chat(messages)], sampling_params)[0]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        parsed = [self._prompt_ids(p) for p in prompts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(parsed)
        for _, ids in parsed:  # refuse the whole batch before starting any of it
            for sp in sps:
                self.engine.check_request(ids, sp)
        t0 = time.perf_counter()
        ids = [[self.engine.add_request(p, child_params(sp, i), prompt=text).request_id
                for i in range(sp.n)] for (text, p), sp in zip(parsed, sps)]
        done, first_token = self._run_to_completion()
        total = time.perf_counter() - t0
        outs = [RequestOutput(text, p, [dataclasses.replace(done[r], index=j) for j, r in enumerate(rids)],
                              request_id=rids[0])
                for (text, p), rids in zip(parsed, ids)]
        metrics = self._metrics(outs, total, max(first_token.values(), default=t0) - t0)
        for o in outs:
            o.metrics = metrics
        return outs

    def _run_to_completion(self) -> tuple[dict[str, CompletionOutput], dict[str, float]]:
        """Step until idle: each request's output, and when its first token came."""
        acc: dict[str, CompletionOutput] = {}
        first_token: dict[str, float] = {}
        while self.engine.has_unfinished():
            for d in self.engine.step():
                first_token.setdefault(d.request_id, time.perf_counter())
                self._accumulate(acc.setdefault(d.request_id, CompletionOutput("", [])), d)
        return acc, first_token

    @staticmethod
    def _accumulate(out: CompletionOutput, d: RequestDelta) -> None:
        out.text += d.text
        out.token_ids += d.token_ids
        if d.logprobs:
            out.logprobs = (out.logprobs or []) + d.logprobs
        out.finish_reason = d.finish_reason

    @staticmethod
    def _metrics(outs: list[RequestOutput], total: float, prefill: float) -> dict:
        n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
        n_seqs = sum(len(o.outputs) for o in outs)
        decode = total - prefill
        return {"prefill_s": prefill, "decode_s": decode, "total_s": total,
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "output_tokens": n_out,
                "decode_tok_s": (n_out - n_seqs) / max(decode, 1e-9)}
