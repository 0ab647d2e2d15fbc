"""Greedy fingerprints: the tests recompute them and compare with tests/fingerprints/.

When a change to the model code, kernels or demo weights is meant to change greedy
outputs, regenerate the file with the command in REGENERATE and commit it with the change.
"""

import json
from pathlib import Path

import pytest

from lowbit.bench.fingerprint import compare, digest
from lowbit.cli import main
from lowbit.formats import FORMATS

HERE = Path(__file__).resolve().parents[1] / "fingerprints"
DEMO = Path(__file__).resolve().parents[2] / "lowbit" / "demo_model"
FLAGS = ["--device", "cpu", "--max-tokens", "16", "--long-len", "200"]  # bf16 weights, fp32 compute
REGENERATE = "lowbit bench fingerprint {model} " + " ".join(FLAGS) + " --out tests/fingerprints/{name}"


def _fingerprint(model: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "fp.json"
    rc = main(["bench", "fingerprint", model, *FLAGS, "--out", str(out), "--records", str(tmp_path / "rec"),
               *extra])
    return rc, json.loads(out.read_text())


def _assert_matches(rec: dict, name: str, model: str) -> None:
    problems = compare(rec, HERE / name)
    assert not problems, ("greedy outputs changed:\n  " + "\n  ".join(problems)
                          + "\nif the change is intended, regenerate the file and commit it:\n  "
                          + REGENERATE.format(model=model, name=name))


@pytest.fixture(scope="module")
def fixture_run(tiny_moe_dir, tmp_path_factory):
    return _fingerprint(str(tiny_moe_dir), tmp_path_factory.mktemp("fp"), "--check",
                        str(HERE / "tiny-moe-bf16.json"))


def test_fixture_model_fingerprint_is_unchanged(fixture_run):
    rc, rec = fixture_run
    assert set(rec["prompts"]) == {"code", "prose", "counting", "long"}
    for p in rec["prompts"].values():
        assert len(p["tokens"]) == 16 and p["sha256"] == digest(p["tokens"])
    assert rec["prompts"]["long"]["prompt_tokens"] == 200
    _assert_matches(rec, "tiny-moe-bf16.json", "TINY_MOE_DIR (the tiny_moe_dir fixture of tests/conftest.py)")
    assert rc == 0  # --check agrees


def test_check_names_the_first_changed_token(fixture_run, tmp_path):
    _, rec = fixture_run
    stored = json.loads((HERE / "tiny-moe-bf16.json").read_text())
    stored["prompts"]["prose"]["sha256"] = "0" * 64
    stored["prompts"]["prose"]["tokens"][3] += 1
    stored["prompts"]["code"]["prompt_sha256"] = "0" * 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(stored))
    problems = compare(rec, bad)
    assert len(problems) == 2
    assert problems[0].startswith("code: the prompt tokens differ")
    assert problems[1].startswith("prose: output differs from token 3")


# the checkpoint as stored, and quantized on load to every format
DEMO_FORMATS = ["bf16", *FORMATS]


@pytest.mark.parametrize("fmt", DEMO_FORMATS)
def test_demo_model_fingerprint_is_unchanged(tmp_path, fmt):
    name = f"demo-{fmt}.json"
    if not (DEMO / "config.json").exists():
        pytest.skip("the demo model is not in this tree")
    quant = [] if fmt == "bf16" else ["--quantization", fmt]
    regenerate = REGENERATE.format(model="demo", name=name) + " ".join(["", *quant])
    assert (HERE / name).exists(), f"no stored demo fingerprint; create it with: {regenerate}"
    _, rec = _fingerprint("demo", tmp_path, *quant)
    assert rec["format"].split()[0] == fmt
    _assert_matches(rec, name, "demo" + " ".join(["", *quant]))
