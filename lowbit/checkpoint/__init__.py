"""Reading and writing weights: HF directories, safetensors shards, lowbit artifacts."""
