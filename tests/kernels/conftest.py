"""Kernel tests run Triton through its CPU interpreter: set it before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
