"""Quantization: which weights take a format (the policy) and the artifact exporter."""
