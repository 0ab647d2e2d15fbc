"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A small random qwen3_moe checkpoint (8 experts, top-2), written once per module."""
    from tests.gpu.test_attention_gpu import _moe_dir

    return _moe_dir(tmp_path_factory.mktemp("moe") / "m")
