"""`lowbit serve --speculative-method ngram` through the openai client: the same greedy text as
the server without it, streamed pieces that add up, and the acceptance counters on /metrics."""

PROMPT = "abcabcabcabc the cat sat on the mat, the cat sat on the"


def test_ngram_server_answers_as_the_plain_one(server, start_server):
    spec = start_server(speculative_method="ngram", num_speculative_tokens=3)
    args = dict(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0)
    want = server.client().completions.create(**args).choices[0].text
    got = spec.client().completions.create(**args).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in spec.client().completions.create(stream=True, **args))
    assert got == want and streamed == want and want
    spec.wait_idle()
    types, samples = spec.metrics()
    assert types["vllm:spec_decode_num_draft_tokens_total"] == "counter"
    drafts = samples["vllm:spec_decode_num_draft_tokens_total"][0][1]
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total"][0][1]
    assert 0 < accepted < drafts  # both paths taken: accepted drafts and rolled-back ones
    assert samples["lowbit:kv_cache_free_blocks"][0][1] == samples["lowbit:kv_cache_blocks"][0][1]
