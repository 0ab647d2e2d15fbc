"""Train the built-in `demo` model: a small qwen3_moe on the demo corpus.

Trains transformers' Qwen3MoeForCausalLM (fp32 weights, bf16 autocast on CUDA) with AdamW and
a warmup + cosine schedule. The schedule ends at whichever comes first of --max-epochs and
--minutes; the held-out split is scored every --eval-every steps and the best weights are kept.
Writes into --out: config.json and model.safetensors in the layout Qwen3-MoE checkpoints
publish (bf16, one tensor per expert projection), generation_config.json and record.json.

    python scripts/demo/train.py --out /tmp/demo_out --minutes 5
    python scripts/demo/train.py --tiny --device cpu --minutes 0.2 --out /tmp/dry  # dry run
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

EOT = "<|endoftext|>"
EOT_ID, IM_END_ID = 0, 2

# The shipped architecture, in the field names of the published Qwen3-MoE config.json files.
DEMO_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 192,
    "intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "max_window_layers": 8,
    "use_sliding_window": False,
    "sliding_window": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.01,
    "bos_token_id": EOT_ID,
    "eos_token_id": EOT_ID,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

TINY_OVERRIDES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "num_experts": 4,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "max_window_layers": 2,
}

GENERATION_CONFIG = {
    "bos_token_id": EOT_ID,
    "eos_token_id": [EOT_ID, IM_END_ID],
    "pad_token_id": EOT_ID,
    "do_sample": True,
    "temperature": 0.8,
    "top_k": 50,
    "top_p": 0.95,
}

PROMPTS = [
    "It is a truth universally acknowledged",
    "In the beginning",
    "HAMLET.\nTo be, or not to be",
    "Mr. Darcy",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=Path("data/demo_corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("lowbit/demo_model/tokenizer.json"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=5.0, help="training time budget")
    p.add_argument("--max-epochs", type=float, default=12.0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny config, for a CPU dry run")
    return p.parse_args()


def encode_documents(tok: Tokenizer, path: Path) -> torch.Tensor:
    """All documents of a split as one token stream, each followed by <|endoftext|>."""
    docs = [d for d in path.read_text(encoding="utf-8").split(EOT) if d.strip()]
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(EOT_ID)
    return torch.tensor(ids, dtype=torch.long)


def build_model(config: dict, device: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_config = Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "torch_dtype"})
    hf_config.output_router_logits = True  # adds the load-balancing loss while training
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(hf_config).to(device)


def count_params(config: dict) -> tuple[int, int]:
    """(total, active per token) parameters; tied embeddings counted once."""
    h, d, layers = config["hidden_size"], config["head_dim"], config["num_hidden_layers"]
    attn = h * d * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"]) + 2 * d
    expert = 3 * h * config["moe_intermediate_size"]
    per_layer_fixed = attn + config["num_experts"] * h + 2 * h  # + router + two norms
    embed = config["vocab_size"] * h
    total = embed + h + layers * (per_layer_fixed + config["num_experts"] * expert)
    active = embed + h + layers * (per_layer_fixed + config["num_experts_per_tok"] * expert)
    return total, active


def make_optimizer(model, lr: float, weight_decay: float, device: str) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device == "cuda")


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def random_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    starts = torch.randint(0, stream.numel() - seq, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq: int, batch: int, device: str) -> float:
    """Mean next-token loss over non-overlapping windows of the held-out stream."""
    model.eval()
    n = stream.numel() // seq
    windows = stream[: n * seq].view(n, seq)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        x = windows[i : i + batch].to(device)
        with autocast(device):
            logits = model(input_ids=x, output_router_logits=False).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def autocast(device: str):
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")


def hub_state_dict(model, tied: bool) -> dict[str, torch.Tensor]:
    """The model's weights in bf16, experts split the way published checkpoints store them.

    transformers keeps each layer's experts fused: gate_up_proj [E, 2*I, H] (gate rows first,
    then up rows) and down_proj [E, H, I]. Checkpoints store
    mlp.experts.{e}.gate_proj.weight [I, H], up_proj.weight [I, H], down_proj.weight [H, I].
    """
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.bfloat16)
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        elif name == "lm_head.weight" and tied:
            continue
        else:
            out[name] = t.contiguous()
    return out


def save_checkpoint(model, config: dict, out: Path) -> None:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tensors = hub_state_dict(model, config["tie_word_embeddings"])
    save_file(
        dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    full = {**config, "transformers_version": transformers.__version__}
    (out / "config.json").write_text(json.dumps(dict(sorted(full.items())), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")


def check_and_sample(out: Path, tok: Tokenizer, heldout: torch.Tensor, args) -> tuple[float, list]:
    """Reload the saved directory with transformers, score the held-out split with it (bf16
    rounding of the weights should barely move the loss), and generate from a few prompts."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"transformers reloaded {out} with problems: {problems}")
    model = model.to(args.device).eval()
    loss = heldout_loss(model, heldout, args.seq_len, args.batch_size, args.device)
    print(f"reloaded from {out}: held-out loss {loss:.4f}, ppl {math.exp(loss):.2f}")
    samples = []
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(prompt).ids], device=args.device)
        torch.manual_seed(i)
        gen = model.generate(ids, max_new_tokens=80, do_sample=i > 0)
        samples.append(tok.decode(gen[0].tolist()))
        print(f"--- sample ({'greedy' if i == 0 else 'sampled'}) ---\n{samples[-1]}")
    return loss, samples


def main() -> None:
    args = parse_args()
    config = {**DEMO_CONFIG, **(TINY_OVERRIDES if args.tiny else {})}
    torch.backends.cuda.matmul.allow_tf32 = True
    tok = Tokenizer.from_file(str(args.tokenizer))
    assert tok.get_vocab_size() == config["vocab_size"], "tokenizer and config disagree"
    assert tok.token_to_id(EOT) == EOT_ID and tok.token_to_id("<|im_end|>") == IM_END_ID

    train = torch.cat(
        [
            encode_documents(tok, args.corpus / "train.txt"),
            encode_documents(tok, args.corpus / "chat.txt"),
        ]
    )
    heldout = encode_documents(tok, args.corpus / "heldout.txt")
    total, active = count_params(config)
    print(
        f"train {train.numel():,} tokens, heldout {heldout.numel():,} tokens; "
        f"params {total:,} total, {active:,} active per token"
    )

    model = build_model(config, args.device)
    assert sum(p.numel() for p in model.parameters()) == total, "count_params is off"
    opt = make_optimizer(model, args.lr, args.weight_decay, args.device)
    tokens_per_step = args.batch_size * args.seq_len
    max_steps = int(args.max_epochs * train.numel() / tokens_per_step)
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60
    best = (float("inf"), None, 0)
    history, window, step = [], [], 0
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        progress = max(step / max_steps, elapsed / budget_s)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args)
        x = random_batch(train, args.batch_size, args.seq_len, gen).to(args.device)
        with autocast(args.device):
            out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window.append((out.loss - config["router_aux_loss_coef"] * out.aux_loss).detach())
        if step % args.eval_every == 0:
            best = evaluate(model, heldout, args, step, window, start, history, best)
            window = []
    train_s = time.perf_counter() - start
    if window:  # else the last step was just evaluated
        best = evaluate(model, heldout, args, step, window, start, history, best)
    model.load_state_dict(best[1])
    save_checkpoint(model, config, args.out)
    reloaded_loss, samples = check_and_sample(args.out, tok, heldout, args)
    record = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "params_total": total,
        "params_active": active,
        "train_tokens": train.numel(),
        "heldout_tokens": heldout.numel(),
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / train.numel(),
        "train_seconds": round(train_s, 1),
        "best_step": best[2],
        "heldout_loss": best[0],
        "heldout_ppl": math.exp(best[0]),
        "reloaded_heldout_ppl": math.exp(reloaded_loss),
        "final_train_loss": history[-1]["train_loss"],
        "history": history,
        "args": {k: str(v) for k, v in vars(args).items()},
        "samples": samples,
    }
    (args.out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("history", "samples")}))


def evaluate(model, heldout, args, step, window, start, history, best):
    loss = heldout_loss(model, heldout, args.seq_len, args.batch_size, args.device)
    train_loss = torch.stack(window).mean().item() if window else float("nan")
    entry = {
        "step": step,
        "seconds": round(time.perf_counter() - start, 1),
        "train_loss": round(train_loss, 4),
        "heldout_loss": round(loss, 4),
        "heldout_ppl": round(math.exp(loss), 2),
    }
    history.append(entry)
    print(json.dumps(entry), flush=True)
    if loss < best[0]:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return (loss, state, step)
    return best


if __name__ == "__main__":
    main()
