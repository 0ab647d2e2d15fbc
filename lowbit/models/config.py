"""ArchConfig: one normalised view of the HF config key zoo.

Every architecture reads its shape from here, never from the raw dict, so the aliases
(num_experts / num_local_experts / n_routed_experts, rope_scaling / rope_parameters, ...)
are resolved in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.errors import LowbitError

SUPPORTED = ("qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss")


def _first(raw: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if raw.get(k) is not None:
            return raw[k]
    return default


@dataclass
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope: dict = field(default_factory=dict)  # rope_type + scaling parameters
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention"
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    moe_layers: list[bool] = field(default_factory=list)  # per layer: sparse MoE block or dense MLP
    scoring_func: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # greedy | group_limited_greedy (deepseek_v2) | noaux_tc (deepseek_v3)
    swiglu_limit: float | None = None
    # MLA (deepseek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs are (2i, 2i+1) instead of (i, i + R/2)
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    quantization_config: dict | None = None
    raw: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, raw: dict) -> ArchConfig:
        mt = raw.get("model_type")
        if mt not in SUPPORTED:
            raise LowbitError(
                f"unknown architecture model_type={mt!r}; lowbit supports {', '.join(SUPPORTED)}"
            )
        try:
            return cls._from_dict(raw, mt)
        except (KeyError, TypeError) as e:
            raise LowbitError(f"config.json for model_type={mt!r} is missing or has a bad field: {e}") from e

    @classmethod
    def _from_dict(cls, raw: dict, mt: str) -> ArchConfig:
        n_layers = int(raw["num_hidden_layers"])
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = dict(_first(raw, "rope_parameters", "rope_scaling", default={}) or {})
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        theta = float(_first(rope, "rope_theta", default=_first(raw, "rope_theta", default=10000.0)))
        n_exp = int(_first(raw, "num_experts", "num_local_experts", "n_routed_experts", default=0))
        eos = raw.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = raw.get("sliding_window")
        if mt in ("qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
            window = None
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if window else "full_attention"
        ] * n_layers
        mla = mt in ("deepseek_v2", "deepseek_v3")
        kv_heads = heads if mla else int(_first(raw, "num_key_value_heads", default=heads))
        head_dim = int(_first(raw, "head_dim", default=hidden // heads))
        if mla:  # every head has its own K/V; head_dim is the q/k head width
            head_dim = int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])
        c = cls(
            model_type=mt,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(_first(raw, "intermediate_size", default=0)),
            rms_norm_eps=float(_first(raw, "rms_norm_eps", default=1e-6)),
            max_position_embeddings=int(_first(raw, "max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope_theta=theta,
            rope=rope,
            sliding_window=window,
            layer_types=list(layer_types),
            num_experts=n_exp,
            num_experts_per_tok=int(_first(raw, "num_experts_per_tok", "experts_per_token", default=0)),
            moe_intermediate_size=int(_first(raw, "moe_intermediate_size", "intermediate_size", default=0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", mt == "mixtral")),
            num_shared_experts=int(_first(raw, "n_shared_experts", default=0)),
            scoring_func=str(raw.get("scoring_func") or ("sigmoid" if mt == "deepseek_v3" else "softmax")),
            n_group=int(_first(raw, "n_group", default=1)),
            topk_group=int(_first(raw, "topk_group", default=1)),
            routed_scaling_factor=float(_first(raw, "routed_scaling_factor", default=1.0)),
            topk_method=str(raw.get("topk_method") or ("noaux_tc" if mt == "deepseek_v3" else "greedy")),
            swiglu_limit=_first(raw, "swiglu_limit", default=7.0 if mt == "gpt_oss" else None),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=int(_first(raw, "kv_lora_rank", default=0)),
            qk_nope_head_dim=int(_first(raw, "qk_nope_head_dim", default=0)),
            qk_rope_head_dim=int(_first(raw, "qk_rope_head_dim", default=0)),
            v_head_dim=int(_first(raw, "v_head_dim", default=0)),
            # deepseek_v2 always rotates interleaved pairs; deepseek_v3 unless told otherwise
            rope_interleave=mt == "deepseek_v2" or (mt == "deepseek_v3" and bool(raw.get("rope_interleave", True))),
            num_nextn_predict_layers=int(_first(raw, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            quantization_config=raw.get("quantization_config"),
            raw=raw,
        )
        c.moe_layers = [c._layer_is_moe(i) for i in range(n_layers)]
        c._validate()
        return c

    def _layer_is_moe(self, i: int) -> bool:
        if not self.is_moe:
            return False
        raw = self.raw
        if self.model_type in ("deepseek_v2", "deepseek_v3"):
            freq = int(raw.get("moe_layer_freq", 1))
            return i >= int(raw.get("first_k_dense_replace", 0)) and i % freq == 0
        if self.model_type == "qwen3_moe":
            step = int(raw.get("decoder_sparse_step", 1))
            return i not in (raw.get("mlp_only_layers") or []) and (i + 1) % step == 0
        return True

    def _validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise LowbitError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise LowbitError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}"
            )
        if len(self.layer_types) != self.num_layers:
            raise LowbitError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer i in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def load_config(path: str | Path) -> ArchConfig:
    """Read and normalise a config.json (a file or a model directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise LowbitError(f"no config.json at {p}; pass an HF model directory or a config file")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise LowbitError(f"{p} is not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(raw, dict):
        raise LowbitError(f"{p} must hold a JSON object")
    return ArchConfig.from_dict(raw)

