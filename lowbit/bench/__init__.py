"""`lowbit bench`: the measurement battery (latency cells, serving load, fingerprints,
interleaved A/B, reports). Every run writes a JSON record under bench/records/."""
