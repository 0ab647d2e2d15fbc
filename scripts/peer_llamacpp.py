"""llama.cpp's quantizer as a peer row for `lowbit eval`: a GGUF's quantized weights put back
into the demo model's HF checkpoint, so that the student runs in lowbit on the teacher's
tokens and windows.

    PYTHONPATH=LLAMA_CPP/gguf-py python scripts/peer_llamacpp.py QUANT.gguf OUT_DIR [--base DIR]

The weights counted are the ones lowbit quantizes (docs/BENCHMARKS.md "Byte budget"): every
attention projection (q, k, v, o) and expert stack (gate, up, down) of the 8 layers,
10,747,904 weights. Each is dequantized with gguf-py's reference decoders to float32 and
written in place of the base checkpoint's tensor; everything else (embedding, norms, router
gates) is the base's, so the student differs from the teacher only in those weights, as
lowbit's own students do. bits/weight = 8 x (the GGUF's stored bytes of those tensors) /
their weight count, with the type each tensor got (llama.cpp falls back to another type
where a row length is not a multiple of the type's block: the expert down projections, K
192, under the 256-wide K- and I-quants). The peer (llama.cpp, built from the
llama-cpp-python source distribution) lives outside the repository; docs/BENCHMARKS.md
("llama.cpp peer rows") has the commands.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj"}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def main() -> None:
    import gguf  # from llama.cpp's gguf-py (PYTHONPATH), the peer's own reader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--base", default="lowbit/demo_model")
    args = ap.parse_args()
    base, out = Path(args.base), Path(args.out)
    state = {k: v.float() for k, v in load_file(base / "model.safetensors").items()}
    reader = gguf.GGUFReader(args.gguf)
    nbytes, nweights, types = 0, 0, Counter()
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if not m or (m.group(2) not in ATTN and m.group(2) not in EXPERTS):
            continue
        layer, kind = int(m.group(1)), m.group(2)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (columns) first
        w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))).float()
        w = w.reshape(shape)
        nbytes += int(t.n_bytes)
        nweights += w.numel()
        types[t.tensor_type.name] += w.numel()
        prefix = f"model.layers.{layer}"
        if kind in ATTN:
            _put(state, f"{prefix}.{ATTN[kind]}.weight", w)
        else:
            for e in range(shape[0]):
                _put(state, f"{prefix}.mlp.experts.{e}.{EXPERTS[kind]}.weight", w[e])
    if nweights == 0:
        raise SystemExit(f"{args.gguf}: no attention or expert weights found")
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    summary = {"gguf": str(args.gguf), "weights": nweights, "bytes": nbytes,
               "bits_per_weight": round(8 * nbytes / nweights, 4),
               "types": {k: v for k, v in types.most_common()}}
    (out / "peer.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def _put(state: dict, name: str, w: torch.Tensor) -> None:
    if name not in state or tuple(state[name].shape) != tuple(w.shape):
        got = None if name not in state else tuple(state[name].shape)
        raise SystemExit(f"{name}: the GGUF gives {tuple(w.shape)}, the base holds {got}")
    state[name] = w


if __name__ == "__main__":
    main()
