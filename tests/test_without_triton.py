"""A runtime-only install has no triton (it is a test dependency): the torch routes must
load, generate and report why the Triton routes refused, with triton unimportable."""

import subprocess
import sys
import textwrap


def test_generate_and_routes_without_triton(tiny_moe_dir):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        sys.modules["triton.language"] = None
        from lowbit import LLM, SamplingParams
        from lowbit.kernels import counters
        from lowbit.kernels.runtime import HAS_TRITON
        assert not HAS_TRITON
        llm = LLM({str(tiny_moe_dir)!r}, device="cpu")
        out = llm.generate(["It is a truth"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        reasons = {{r["reason"] for r in counters()["route_refusals"]}}
        assert any("triton is not installed" in r for r in reasons), reasons
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
