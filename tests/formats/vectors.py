"""Load tests/vectors/<format>.json and check a format against it, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats import get_format

VECTORS = Path(__file__).resolve().parent.parent / "vectors"


def load(name: str) -> list[dict]:
    return json.loads((VECTORS / f"{name}.json").read_text())["cases"]


def floats(hexes: list[str], shape: list[int]) -> torch.Tensor:
    return torch.tensor([float.fromhex(h) for h in hexes], dtype=torch.float32).reshape(shape)


def tensor(entry: dict) -> torch.Tensor:
    data = torch.frombuffer(bytearray(bytes.fromhex(entry["hex"])), dtype=torch.uint8)
    return data.view(getattr(torch, entry["dtype"])).reshape(entry["shape"]).clone()


def raw_hex(t: torch.Tensor) -> str:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


def check(name: str) -> int:
    """Every case of the format's vectors reproduces exactly; returns the case count."""
    fmt = get_format(name)
    cases = load(name)
    for case in cases:
        w = floats(case["input"], case["shape"]).to(getattr(torch, case["input_dtype"]))
        if "error" in case:
            with pytest.raises(LowbitError):
                fmt.encode(w)
            continue
        want = {k: tensor(v) for k, v in case["payload"].items()}
        kwargs = {k: want[k] for k in case.get("encode_with", [])}
        got = fmt.encode(w, **kwargs)
        assert set(got) == set(want), case["name"]
        for key, t in want.items():
            assert got[key].dtype == t.dtype and got[key].shape == t.shape, (case["name"], key)
            assert raw_hex(got[key]) == raw_hex(t), (case["name"], key)
        decoded = fmt.decode(want, tuple(case["shape"]))
        expect = floats(case["decoded"], case["shape"])
        assert raw_hex(decoded) == raw_hex(expect), case["name"]
    return len(cases)
