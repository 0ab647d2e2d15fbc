"""Prefill graphs: buckets, the padded staging a captured prefill step reads, and the captured
step function run on the CPU on those padded inputs (the capture itself needs CUDA:
tests/gpu/test_decode_graph_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lowbit import LLM, SamplingParams
from lowbit.engine.prefill_graphs import HIDDEN, PrefillGraphs, seq_buckets, token_buckets
from lowbit.engine.staging import Padding, StepInputs
from lowbit.kernels import attention_op, routes
from lowbit.kernels.attention import reference_paged_attention

PROMPTS = ["Once upon a time there was a river town where the boats", "The river", "A third one, longer "
           "than the chunk budget of sixteen tokens, so that it is cut into pieces"]


def test_buckets():
    assert token_buckets(2048) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_buckets(100) == [2, 4, 8, 16, 32, 64, 100]
    assert token_buckets(8192)[-3:] == [7168, 7680, 8192]
    assert seq_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert seq_buckets(6) == [1, 2, 4, 6] and seq_buckets(1) == [1]


def test_bucket_for_pads_a_sequence_for_the_padded_tokens():
    g = PrefillGraphs(torch.nn.Identity(), None, None, None, 2048, 8, torch.device("cpu"), None)
    assert g.bucket_for(512, 1) == (512, 1)  # exact: no padded sequence
    assert g.bucket_for(500, 1) == (512, 2)  # 12 padded tokens form sequence 1
    assert g.bucket_for(2048, 8) == (2048, 8)
    assert g.bucket_for(2047, 8) == (2048, 9)  # a full batch: the padded sequence is the ninth
    assert g.bucket_for(2049, 1) is None


def test_prefill_padding_is_one_fresh_prompt_over_the_scratch_block():
    inputs = StepInputs(32, 4, 3, Padding(scratch_row=99, scratch_block=7, sampler_row=5), torch.device("cpu"))
    values = {"input_ids": [3, 4, 5, 6, 8], "positions": [0, 1, 2, 9, 4], "slot_mapping": [10, 11, 12, 41, 20],
              "seq_lens": [3, 10, 5], "rows": [0, 1, 2], "steps": [3, 10, 5], "query_start": [0, 3, 4, 5],
              "last_index": [2, 3, 4], "sample_rows": [0, 5, 2], "picks": [0, 2]}
    inputs.stage(values, [[0], [2, 3], [1]], pad_to=4, pad_tokens=16)
    inputs.upload()
    tok, seq = inputs.tokens(16), inputs.seqs(4)
    assert tok["input_ids"].tolist() == [3, 4, 5, 6, 8] + [0] * 11
    assert tok["slot_mapping"].tolist()[5:] == [99] * 11
    assert seq["query_start"].tolist() == [0, 3, 4, 5, 16]
    assert seq["seq_lens"].tolist() == [3, 10, 5, 11]  # the padded prompt's 11 tokens
    assert seq["sample_rows"].tolist() == [0, 5, 2, 5] and seq["last_index"].tolist() == [2, 3, 4, 0]
    assert seq["picks"].tolist() == [0, 2, 0, 0]
    assert inputs.block_tables[3].tolist() == [7, 7, 7]
    # a decode bucket pads tokens and sequences alike: padded sequence i owns token i
    dec = {"input_ids": [1, 2], "positions": [5, 6], "slot_mapping": [1, 2], "seq_lens": [6, 7],
           "rows": [0, 1], "steps": [6, 7], "query_start": [0, 1, 2], "last_index": [0, 1], "sample_rows": [0, 1], "picks": [0, 1]}
    inputs.stage(dec, [[0], [1]], pad_to=4)
    inputs.upload()
    assert inputs.seqs(4)["query_start"].tolist() == [0, 1, 2, 3, 4]
    assert inputs.seqs(4)["seq_lens"].tolist() == [6, 7, 1, 1]


class StaticPrefill(PrefillGraphs):
    """A stand-in for the prefill graphs on the CPU: each "replay" runs the captured step
    function eagerly on the padded static inputs."""

    def ready(self, bucket, mode=None) -> bool:
        self._outputs(self.model.config.vocab_size)
        self.graphs[(*bucket, mode)] = None
        return True

    def run(self, bucket, mode=None):
        t, b = bucket
        self.shapes.append(bucket)
        self._step(t, b, mode)
        self.replays += 1
        return self.tokens[:b], self.logits[:b]

    def run_hidden(self, bucket):
        t, b = bucket
        self.shapes.append((t, b, HIDDEN))
        self._step(t, b, HIDDEN)
        self.replays += 1
        return self.hidden[:t]


def install_static(runner, max_tokens: int) -> None:
    """Give the runner a StaticPrefill of buckets up to max_tokens tokens and 4 sequences (5 rows)."""
    runner.prefill_graphs = StaticPrefill(runner.model, runner.inputs, runner.sampling, runner.kv_cache,
                                          max_tokens, 4, runner.device, SimpleNamespace(pool=None))
    runner.prefill_graphs.shapes = []


@pytest.fixture
def device_read_prefill(monkeypatch) -> list[tuple[int, int]]:
    """The torch attention route made to read a prefill call's starts and lengths from the
    device (query_start_dev, seq_lens), as the graph-safe Triton route does; each such call's
    (T, B) recorded."""
    route = routes.ops()["attention"].get("torch")
    run, seen = route.run, []

    def run_prefill(call):
        if call.decode or call.pool is None or call.query_start_dev is None:
            return run(call)
        seen.append((call.q.shape[0], call.block_tables.shape[0]))
        return reference_paged_attention(call.q, call.pool, call.block_tables, call.query_start_dev.tolist(),
                                         call.seq_lens.tolist(), call.scale, call.window, call.sinks)

    monkeypatch.setattr(route, "run", run_prefill)
    return seen


def static_against_eager(prompts: list[str], sp: SamplingParams) -> list[tuple]:
    """The demo in 16-token steps over 4 sequences, with a StaticPrefill, gives the eager
    engine's tokens; the shapes its prefill steps ran at."""
    kw = dict(device="cpu", kv_cache_tokens=512, max_num_batched_tokens=16, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in LLM("demo", **kw).generate(prompts, sp)]
    llm = LLM("demo", **kw)
    install_static(llm.engine.runner, 16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    return llm.engine.runner.prefill_graphs.shapes


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8, seed=3, repetition_penalty=1.2)])
def test_padded_prefill_steps_give_the_eager_tokens(device_read_prefill, params):
    """Chunked prompts beside decodes (16-token steps): every step that is not a pure decode
    runs the prefill step function on the bucket's padded inputs; greedy and seeded sampled
    tokens (with penalties, which count on the sampler rows) are the eager engine's."""
    shapes = static_against_eager(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, **params))
    assert shapes and all(t == 16 for t, _ in shapes), shapes
    assert any(b > 1 for _, b in shapes)  # mixed steps (chunks beside decodes, or a padded prompt)
    assert device_read_prefill and all(t == 16 for t, _ in device_read_prefill)


def test_prompt_logprobs_and_hooks_keep_steps_eager():
    llm = LLM("demo", device="cpu", kv_cache_tokens=256)
    r = llm.engine.runner
    install_static(r, 64)
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert r.prefill_graphs.shapes == []
    r.before_forward.append(lambda batch, ids: None)
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=2))
    assert r.prefill_graphs.shapes == []
    r.before_forward.clear()
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=2))
    assert len(r.prefill_graphs.shapes) == 1


def test_verify_steps_run_the_hidden_step_on_padded_inputs(device_read_prefill):
    """Speculative verify steps (ngram drafts) take the bucket's HIDDEN step (what a replayed
    verify graph runs: every layer on the padded static inputs, hidden states out); greedy
    tokens are still those of the engine without speculation, and the runner counts those
    steps."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat sat on", "one two one two one"]
    kw = dict(device="cpu", kv_cache_tokens=1024, max_num_batched_tokens=64, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in LLM("demo", **kw).generate(prompts, sp)]
    llm = LLM("demo", speculative_method="ngram", num_speculative_tokens=3, **kw)
    r = llm.engine.runner
    install_static(r, 64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    hidden = [x for x in r.prefill_graphs.shapes if len(x) == 3]
    assert hidden and r.spec_graph_steps == len(hidden)
    assert llm.engine.spec.stats.mean_accepted_length > 1  # drafts were verified, some kept


def test_refusal_names_the_route(monkeypatch):
    assert attention_op.prefill_graph_refusal("attention") is None
    assert attention_op.prefill_graph_refusal("latent_attention") is None
    monkeypatch.setenv("LOWBIT_ROUTE_LATENT_ATTENTION", "torch")
    assert "torch" in attention_op.prefill_graph_refusal("latent_attention")
    monkeypatch.setenv("LOWBIT_ROUTE_ATTENTION", "torch")
    assert "LOWBIT_ROUTE_ATTENTION=torch" in attention_op.prefill_graph_refusal("attention")


def test_a_full_batch_pads_into_the_extra_sequence_bucket(device_read_prefill):
    """--max-num-seqs requests at once: a mixed step of all of them whose tokens pad to a
    bucket needs one more sequence row (the padded prompt); it replays the (T', max + 1)
    graph with the eager engine's tokens instead of running eagerly."""
    prompts = PROMPTS + ["Four at once, so the batch is full"]
    shapes = static_against_eager(prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    assert (16, 5) in shapes, shapes
