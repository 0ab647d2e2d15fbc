"""`LLM`: the offline Python API. Load once, generate for a batch of prompts.

Each step runs every unfinished sequence through one flat ForwardBatch over a contiguous
KV cache: the first step prefills all prompts, later steps decode one token each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lowbit.checkpoint.loader import LoadedModel, load_model
from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.engine.batch import ForwardBatch
from lowbit.engine.detokenizer import IncrementalDetokenizer
from lowbit.engine.kv_cache import ContiguousKVCache
from lowbit.engine.sampling import SamplingParams, sample
from lowbit.errors import LowbitError


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict = field(default_factory=dict)


@dataclass
class _Seq:
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM:
    def __init__(self, model: str = "demo", *, dtype: str = "auto", device: str | None = None,
                 random_weights: bool = False, config: str | None = None,
                 max_model_len: int | None = None, tokenizer: str | None = None) -> None:
        self.device = device or default_device()
        if dtype == "auto":  # bf16 on a GPU; float32 on the CPU, where bf16 matmuls are slow
            dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.loaded: LoadedModel = load_model(model, dtype=dtype, device=self.device,
                                              random_weights=random_weights, config=config)
        self.model, self.config = self.loaded.model, self.loaded.config
        tok_dir = tokenizer or self.loaded.path
        self.tokenizer = Tokenizer(tok_dir) if tok_dir is not None else None
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        eos = list(self.loaded.generation_config.get("eos_token_id") or self.config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.token_id(self.tokenizer.eos_token) is not None:
            eos.append(self.tokenizer.token_id(self.tokenizer.eos_token))
        self.eos_ids = set(eos)

    # -- inputs ---------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LowbitError("this model has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise LowbitError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise LowbitError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(ids) >= self.max_model_len:
            raise LowbitError(
                f"the prompt has {len(ids)} tokens but the context is {self.max_model_len}; "
                "shorten the prompt or raise --max-model-len"
            )
        return text, ids

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], sampling_params)[0]

    # -- generation -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        parsed = [self._prompt_ids(p) for p in prompts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(parsed)
        seqs = [self._new_seq(ids, sp) for (_, ids), sp in zip(parsed, sps)]
        t0 = time.perf_counter()
        with torch.inference_mode():
            prefill_s = self._run(seqs)
        total = time.perf_counter() - t0
        n_out = sum(len(s.out_ids) for s in seqs)
        metrics = {"prefill_s": prefill_s, "decode_s": total - prefill_s, "total_s": total,
                   "prompt_tokens": sum(len(s.prompt_ids) for s in seqs), "output_tokens": n_out,
                   "decode_tok_s": (n_out - len(seqs)) / max(total - prefill_s, 1e-9)}
        return [RequestOutput(text, s.prompt_ids, [CompletionOutput(s.text, s.out_ids, s.finish)], metrics)
                for (text, _), s in zip(parsed, seqs)]

    def _new_seq(self, ids: list[int], sp: SamplingParams) -> _Seq:
        room = self.max_model_len - len(ids)
        sp = SamplingParams(**{**sp.__dict__, "max_tokens": min(sp.max_tokens or room, room)})
        g = torch.Generator(device=self.device).manual_seed(sp.seed) if sp.seed is not None else None
        if g is None and not sp.greedy:
            g = torch.Generator(device=self.device).manual_seed(torch.seed() % 2**63)
        return _Seq(ids, sp, IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None, g)

    def _run(self, seqs: list[_Seq]) -> float:
        max_len = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs)
        cache = ContiguousKVCache(self.config.num_layers, len(seqs), max_len)
        t0 = time.perf_counter()
        prefill_s = None
        live = list(range(len(seqs)))
        while live:
            new = [seqs[i].prompt_ids if not seqs[i].out_ids else seqs[i].out_ids[-1:] for i in live]
            ctx = [0 if not seqs[i].out_ids else len(seqs[i].prompt_ids) + len(seqs[i].out_ids) - 1 for i in live]
            batch = ForwardBatch.build([len(n) for n in new], ctx, live, cache, self.device)
            ids = torch.tensor([t for n in new for t in n], device=self.device)
            hidden = self.model(ids, batch)
            last = torch.tensor(batch.query_start[1:], device=self.device) - 1
            logits = self.model.compute_logits(hidden[last])  # [B, V]
            tokens = sample(logits, [seqs[i].params for i in live], [seqs[i].generator for i in live])
            for i, tok in zip(live, tokens.tolist()):
                self._append(seqs[i], tok)
            if prefill_s is None:
                prefill_s = time.perf_counter() - t0
            live = [i for i in live if seqs[i].finish is None]
        return prefill_s or 0.0

    def _append(self, s: _Seq, tok: int) -> None:
        s.out_ids.append(tok)
        p = s.params
        if s.detok is not None:
            s.text += s.detok.add(tok)
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            s.finish = "stop"
            if s.detok is not None:  # the eos token itself is not part of the text
                s.text = s.detok.tokenizer.decode(s.out_ids[:-1])
        for stop in p.stop:
            at = s.text.find(stop)
            if at >= 0:
                s.text, s.finish = s.text[:at], "stop"
        if s.finish is None and len(s.out_ids) >= p.max_tokens:
            s.finish = "length"
