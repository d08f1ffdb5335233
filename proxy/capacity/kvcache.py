"""KV-cache size per token: what a context costs in GPU memory.

Standard attention keeps a key and a value per layer and KV head:
``2 x layers x kv_heads x head_dim x bytes``. Multi-head latent attention
(DeepSeek-V2/V3, ``kv_lora_rank`` in config.json) keeps one compressed latent
plus the rotary key part per layer instead: ``layers x (kv_lora_rank +
qk_rope_head_dim) x bytes``, which is what vLLM allocates for MLA models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class KVShape:
    name: str
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    mla_latent_dim: int = 0  # kv_lora_rank + qk_rope_head_dim, for MLA models

    def bytes_per_token(self, dtype: str = "fp16") -> int:
        try:
            width = DTYPE_BYTES[dtype.lower()]
        except KeyError:
            raise ValueError(f"unknown KV dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None
        if self.mla_latent_dim:
            return self.layers * self.mla_latent_dim * width
        return 2 * self.layers * self.kv_heads * self.head_dim * width


PRESETS: dict[str, KVShape] = {
    shape.name: shape
    for shape in (
        KVShape("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128),
        KVShape("llama-3.1-70b", layers=80, kv_heads=8, head_dim=128),
        KVShape("llama-3.1-405b", layers=126, kv_heads=8, head_dim=128),
        KVShape("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        KVShape("qwen2.5-14b", layers=48, kv_heads=8, head_dim=128),
        KVShape("qwen2.5-32b", layers=64, kv_heads=8, head_dim=128),
        KVShape("qwen2.5-72b", layers=80, kv_heads=8, head_dim=128),
        KVShape("mistral-7b", layers=32, kv_heads=8, head_dim=128),
        KVShape("deepseek-v3", layers=61, mla_latent_dim=512 + 64),
    )
}


def shape_from_hf_config(config: dict[str, Any], name: str = "custom") -> KVShape:
    """Read the KV shape from a Hugging Face ``config.json`` (text config of multimodal models too)."""
    config = config.get("text_config", config)
    layers = int(config["num_hidden_layers"])
    if config.get("kv_lora_rank"):
        return KVShape(
            name,
            layers=layers,
            mla_latent_dim=int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0)),
        )
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return KVShape(name, layers=layers, kv_heads=kv_heads, head_dim=head_dim)


def resolve_shape(model: str | None, config_json: str | None = None) -> KVShape:
    if config_json:
        return shape_from_hf_config(json.loads(Path(config_json).read_text()), Path(config_json).parent.name)
    key = (model or "").lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)} (or pass --config-json)")
    return PRESETS[key]


def format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe(model: str | None, context: int, dtype: str = "fp16", config_json: str | None = None) -> str:
    shape = resolve_shape(model, config_json)
    per_token = shape.bytes_per_token(dtype)
    kind = "MLA latent" if shape.mla_latent_dim else f"{shape.kv_heads} KV heads x {shape.head_dim}"
    return (
        f"{shape.name}: {shape.layers} layers, {kind}, {dtype}\n"
        f"per token: {format_bytes(per_token)}\n"
        f"{context} tokens: {format_bytes(per_token * context)}"
    )
