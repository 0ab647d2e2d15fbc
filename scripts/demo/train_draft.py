"""Train the built-in `demo-draft` model: a 2-layer draft of the demo model, for speculative decoding.

The draft has the demo model's architecture (qwen3_moe, same tokenizer, width and experts)
with --layers decoder layers. It starts from the demo model itself: the embedding, the final
norm and the layers named by --init-layers are copied (a layer-skipping draft), then every
weight is trained by distillation: the KL from the demo model's next-token distribution to
the draft's on random windows of the training split (plus --ce-weight of the plain
next-token loss). The schedule is warmup + cosine and ends at --minutes or --max-steps;
the held-out split is scored every --eval-every steps by the draft's top-1 agreement with
the demo model (the share of positions where both pick the same greedy token: the accept
rate of a greedy draft token given the previous ones were right), and the best weights are kept.

Writes into --out the checkpoint (config.json, model.safetensors, generation_config.json, in
the layout train.py writes), the tokenizer files of the demo model, and record.json.

    python scripts/demo/train_draft.py --out lowbit/demo_draft                   # CPU, 25 min
    python scripts/demo/train_draft.py --out /tmp/draft --minutes 3 --device cuda
    python scripts/demo/train_draft.py --out /tmp/dry --minutes 0.2 --max-heldout 2048  # dry run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("demo_train", HERE / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", type=Path, default=Path("lowbit/demo_model"))
    p.add_argument("--corpus", type=Path, default=Path("data/demo_corpus"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--init-layers", default="0,1",
                   help="teacher layers copied into the draft's layers ('' for a random start)")
    p.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-heldout", type=int, default=16_384, help="held-out tokens scored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def load_teacher(path: Path, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def draft_config(teacher_dir: Path, layers: int) -> dict:
    config = json.loads((teacher_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    return {**config, "num_hidden_layers": layers, "max_window_layers": layers}


def build_draft(config: dict, teacher, init_layers: list[int], device: str):
    """The draft, its embedding and final norm copied from the teacher, its layer i from the
    teacher's layer init_layers[i] (the rest of the layers random)."""
    draft = train.build_model(config, device)
    draft.config.output_router_logits = True
    src, dst = teacher.model, draft.model
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        dst.norm.weight.copy_(src.norm.weight)
        if not config["tie_word_embeddings"]:
            draft.lm_head.weight.copy_(teacher.lm_head.weight)
        for i, j in enumerate(init_layers):
            dst.layers[i].load_state_dict(src.layers[j].state_dict())
    return draft


def distill_loss(draft_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || draft)."""
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    return (teacher_logp.exp() * (teacher_logp - logq)).sum(-1).mean()


@torch.no_grad()
def agreement(draft, teacher, stream: torch.Tensor, seq: int, batch: int, device: str) -> dict:
    """On non-overlapping held-out windows: the share of positions where the draft's greedy
    token is the teacher's, the mean KL(teacher || draft) and the draft's next-token loss."""
    draft.eval()
    n = stream.numel() // seq
    windows = stream[: n * seq].view(n, seq)
    same = kl = ce = count = 0.0
    for i in range(0, n, batch):
        x = windows[i : i + batch].to(device)
        with train.autocast(device):
            t = teacher(input_ids=x).logits.float()
            d = draft(input_ids=x, output_router_logits=False).logits.float()
        tl = F.log_softmax(t, dim=-1)
        dl = F.log_softmax(d, dim=-1)
        same += (t.argmax(-1) == d.argmax(-1)).sum().item()
        kl += (tl.exp() * (tl - dl)).sum().item()
        ce += F.nll_loss(dl[:, :-1].reshape(-1, dl.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x.numel()
    draft.train()
    return {"top1_agreement": same / count, "kl": kl / count,
            "heldout_ppl": math.exp(ce / (count - windows[:n].size(0)))}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    tok = Tokenizer.from_file(str(args.teacher / "tokenizer.json"))
    init_layers = [int(x) for x in args.init_layers.split(",") if x.strip()]
    if len(init_layers) > args.layers:
        raise SystemExit(f"--init-layers names {len(init_layers)} layers; the draft has {args.layers}")
    config = draft_config(args.teacher, args.layers)
    teacher = load_teacher(args.teacher, args.device)
    if any(j >= teacher.config.num_hidden_layers for j in init_layers):
        raise SystemExit(f"--init-layers {args.init_layers}: the teacher has "
                         f"{teacher.config.num_hidden_layers} layers")
    stream = torch.cat([train.encode_documents(tok, args.corpus / "train.txt"),
                        train.encode_documents(tok, args.corpus / "chat.txt")])
    heldout = train.encode_documents(tok, args.corpus / "heldout.txt")[: args.max_heldout]
    draft = build_draft(config, teacher, init_layers, args.device)
    total, active = train.count_params(config)
    print(f"draft: {args.layers} layers from teacher layers {init_layers or 'none'}; "
          f"params {total:,} total, {active:,} active per token", flush=True)
    opt = train.make_optimizer(draft, args.lr, args.weight_decay, args.device)
    gen = torch.Generator().manual_seed(args.seed)
    score = agreement(draft, teacher, heldout, args.seq_len, args.batch_size * 4, args.device)
    history = [{"step": 0, "seconds": 0.0, **score}]
    print(json.dumps(history[-1]), flush=True)
    best = (score["top1_agreement"], {k: v.clone() for k, v in draft.state_dict().items()}, 0)
    budget_s, step, window = args.minutes * 60, 0, []
    start = time.perf_counter()
    while True:
        progress = max(step / args.max_steps, (time.perf_counter() - start) / budget_s)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = train.lr_at(step, progress, args)
        x = train.random_batch(stream, args.batch_size, args.seq_len, gen).to(args.device)
        with torch.no_grad(), train.autocast(args.device):
            teacher_logp = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
        with train.autocast(args.device):
            out = draft(input_ids=x, labels=x)
        loss = distill_loss(out.logits, teacher_logp) + args.ce_weight * out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        window.append(loss.detach())
        if step % args.eval_every == 0:
            score = agreement(draft, teacher, heldout, args.seq_len, args.batch_size * 4, args.device)
            history.append({"step": step, "seconds": round(time.perf_counter() - start, 1),
                            "train_loss": round(torch.stack(window).mean().item(), 4), **score})
            window = []
            print(json.dumps(history[-1]), flush=True)
            if score["top1_agreement"] > best[0]:
                best = (score["top1_agreement"], {k: v.clone() for k, v in draft.state_dict().items()}, step)
    train_s = time.perf_counter() - start
    draft.load_state_dict(best[1])
    train.save_checkpoint(draft, config, args.out)
    for name in TOKENIZER_FILES:
        shutil.copy(args.teacher / name, args.out / name)
    record = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "teacher": str(args.teacher),
        "layers": args.layers,
        "init_layers": init_layers,
        "params_total": total,
        "params_active": active,
        "steps": step,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "train_seconds": round(train_s, 1),
        "best_step": best[2],
        "heldout_top1_agreement": best[0],
        "history": history,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "history"}))


if __name__ == "__main__":
    main()
