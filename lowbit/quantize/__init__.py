"""Quantization: hybrid expert plans (policy.py) and the artifact exporter. Which weights a
format replaces is lowbit.checkpoint.quant_plan, which the loader uses too."""
