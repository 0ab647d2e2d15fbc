"""Requests, batches, KV cache, sampling and the generation loop."""
