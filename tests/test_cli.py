import json

from lowbit.cli import main
from lowbit.formats import FORMATS


def test_generate_prints_text_speed_and_format(tiny_moe_dir, capsys):
    rc = main(["generate", str(tiny_moe_dir), "It is a truth", "--max-tokens", "5", "--ignore-eos"])
    cap = capsys.readouterr()
    assert rc == 0
    assert cap.out.startswith("It is a truth") and "tok/s" not in cap.out  # stdout: the text alone
    assert "tok/s" in cap.err and "weights bf16" in cap.err and "5 tokens" in cap.err


def test_generate_is_deterministic_greedy(tiny_moe_dir, capsys):
    args = ["generate", str(tiny_moe_dir), "In the beginning", "--max-tokens", "6", "--ignore-eos"]
    main(args)
    a = capsys.readouterr().out.splitlines()[0]
    main(args)
    assert capsys.readouterr().out.splitlines()[0] == a


def test_bad_sampling_values_give_one_sentence(tiny_moe_dir, capsys):
    for flag, val, msg in [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                           ("--top-p", "nan", "top_p"), ("--max-tokens", "0", "max_tokens")]:
        rc = main(["generate", str(tiny_moe_dir), "hi", flag, val])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("lowbit: error:") and msg in err and "Traceback" not in err


def test_prompt_longer_than_context(tiny_moe_dir, capsys):
    rc = main(["generate", str(tiny_moe_dir), "word " * 400])
    assert rc == 2 and "context" in capsys.readouterr().err


def test_unknown_model_and_architecture(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "hi"]) == 2
    assert "neither a built-in name" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["info", str(tmp_path)]) == 2
    assert "unknown architecture model_type='bert'" in capsys.readouterr().err


def test_info_counts_parameters(tiny_moe_dir, capsys):
    assert main(["info", str(tiny_moe_dir)]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "active per token" in out and "bytes" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[-(len(FORMATS) + 1):]}  # per-format table
    assert set(rows) >= {"bf16", "nvfp4", "nf3", "int4", "fp8"}
    bits = {k: float(v[3]) for k, v in rows.items()}  # tiny widths pad to whole blocks
    assert bits["bf16"] == 16 and 4.5 <= bits["nvfp4"] < 4.8 and bits["nf3"] > 3.25
    assert bits["nvfp4"] < bits["fp8"] < bits["bf16"]


def test_info_of_a_real_config_prints_sizes_per_format(capsys):
    cfg = "lowbit/model_configs/Qwen__Qwen3-30B-A3B.json"
    assert main(["info", "x", "--random-weights", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "30.53B total, 3.35B active" in out
    nvfp4 = next(ln for ln in out.splitlines() if ln.split()[:1] == ["nvfp4"])
    assert nvfp4.split()[1:4] == ["16.85", "GiB", "4.50"]


def test_routes_lists_registry_and_counts_a_run(tiny_moe_dir, capsys):
    assert main(["routes", "--run", str(tiny_moe_dir)]) == 0
    out = capsys.readouterr().out
    for op in ("linear", "moe", "attention"):
        assert f"\n{op} " in out
    assert "MEASURED_NEGATIVE" in out and "DEFAULT" in out
    rows = [ln.split() for ln in out.splitlines()]
    dense_linear = [r for r in rows if r[:2] == ["linear", "dense"]][0]
    assert int(dense_linear[3]) > 0  # the dense route served the run's (bf16) linear calls
    for op in ("norm", "rope", "router", "sample"):  # every hot op goes through the registry
        assert f"\n{op} " in out


def test_misspelt_route_variables_fail_before_loading(tmp_path, monkeypatch, capsys):
    # the model does not exist: an error about the variable proves it was checked first
    for key, value, msg in [("LOWBIT_ROUTE_LINAER", "torch", "names no op"),
                            ("LOWBIT_ROUTE_SAMPLR", "torch", "names no op"),
                            ("LOWBIT_ROUTE_LINEAR", "TORCH", "valid names")]:
        monkeypatch.setenv(key, value)
        assert main(["generate", str(tmp_path / "nope"), "hi"]) == 2
        err = capsys.readouterr().err
        assert key in err and msg in err and "Traceback" not in err
        assert main(["routes"]) == 2
        assert key in capsys.readouterr().err
        monkeypatch.delenv(key)


def test_bad_files_give_one_sentence(tiny_moe_dir, tmp_path, capsys):
    import shutil

    junk = tmp_path / "junk"
    shutil.copytree(tiny_moe_dir, junk)
    next(junk.glob("*.safetensors")).write_bytes(b"\x00\x01not a header")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases = [(["generate", str(junk), "hi"], "not a readable safetensors file"),
             (["eval", str(tiny_moe_dir), "--teacher", str(tiny_moe_dir), "--text", str(tmp_path / "no.txt")],
              "no such file"),
             (["eval", str(tiny_moe_dir), "--teacher", str(tiny_moe_dir), "--text", str(tmp_path / "latin1.txt")],
              "not UTF-8"),
             (["quantize", str(tiny_moe_dir), "--format", "nf4", "--out", "/proc/nope/x"], "cannot create")]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (argv, err[-500:])
    art = tmp_path / "art"
    assert main(["quantize", str(tiny_moe_dir), "--format", "nf4", "--out", str(art)]) == 0
    capsys.readouterr()
    assert main(["quantize", str(art), "--format", "nf4", "--out", str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    (art / "lowbit.json").unlink()
    assert main(["generate", str(art), "hi"]) == 2
    assert "lowbit.json, its manifest, is missing" in capsys.readouterr().err
