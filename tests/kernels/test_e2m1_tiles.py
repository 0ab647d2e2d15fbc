"""decode.e2m1_tile_bf16 in the interpreter: exact bf16 tiles (tests/gpu has the PTX twin)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.e2m1_tiles import probe


@pytest.mark.parametrize("bk", [16, 64])
def test_e2m1_tiles_exact(bk):
    got, want = probe("cpu", bk=bk)
    assert torch.equal(got.float(), want.float())
