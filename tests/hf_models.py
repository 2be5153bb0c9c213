"""Tiny random-weight Hugging Face MoE checkpoints for tests (transformers is a test-only dependency).

transformers 5.24 keeps routed experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H] with
gate rows first, `mlp.experts.down_proj` [E, H, I]) but `save_pretrained` reverts them to the
per-expert names of the hub checkpoints (`mlp.experts.E.{gate,up,down}_proj.weight`; Mixtral
`block_sparse_moe.experts.E.w1/w3/w2.weight`). `layout="fused"` writes the in-memory state dict
instead, which transformers loads as well, so both layouts the converter accepts are covered.

    ckpt = tiny_checkpoint("qwen2_moe", tmp_path / "hf", layout="fused", max_shard_size="20KB")
    ckpt.model(input_ids).logits   # the transformers reference
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (AutoModelForCausalLM, DeepseekV2Config, MixtralConfig, OlmoeConfig,  # noqa: E402
                          PretrainedConfig, PreTrainedModel, Qwen2MoeConfig, Qwen3MoeConfig)

ARCHS = ("olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2")
LAYOUTS = ("per_expert", "fused")

# Small enough to build in milliseconds, big enough to exercise GQA, top-k > 1 and several layers.
_COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False)
_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "olmoe": (OlmoeConfig, dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": (Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                       num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=40, num_experts=8,
                                       num_experts_per_tok=2)),
    "mixtral": (MixtralConfig, dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    # MLA with every head size different (so a mixed-up split shows), a dense first layer, two shared
    # experts and a routed scale other than 1; q_lora_rank=None is Lite's, set it for V2's q bottleneck.
    "deepseek_v2": (DeepseekV2Config, dict(num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
                                           intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                                           num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.5,
                                           q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6,
                                           qk_rope_head_dim=4, v_head_dim=8)),
}


@dataclass
class TinyCheckpoint:
    model: PreTrainedModel  # eval mode, the weights written to `path`
    path: Path


def tiny_config(arch: str, **overrides) -> PretrainedConfig:
    if arch not in _CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    cls, specific = _CONFIGS[arch]
    return cls(**{**_COMMON, **specific, **overrides})


def build_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A seeded random-weight model; HF's init std (0.02) is raised so experts and routers matter."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
            else:  # non-unit norm weights catch a model that forgets to apply them
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def save_checkpoint(model: PreTrainedModel, out: Path, layout: str = "per_expert",
                    max_shard_size: str | int | None = None) -> Path:
    """Write `model` as a HF checkpoint directory in the given expert layout, sharded if asked."""
    out = Path(out)
    if layout == "per_expert":
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, **kwargs)
    elif layout == "fused":
        model.config.save_pretrained(out)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        _save_shards(state, out, _parse_size(max_shard_size) if max_shard_size else None)
    else:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    return out


def tiny_checkpoint(arch: str, out: Path, layout: str = "per_expert", max_shard_size: str | int | None = None,
                    seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> TinyCheckpoint:
    model = build_model(arch, seed=seed, dtype=dtype, **overrides)
    return TinyCheckpoint(model, save_checkpoint(model, out, layout, max_shard_size))


def expert_weights(model: PreTrainedModel, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) of one routed expert, read from the live model."""
    experts = model.model.layers[layer].mlp.experts
    inter = experts.down_proj.shape[-1]
    gate_up = experts.gate_up_proj[expert]
    return gate_up[:inter], gate_up[inter:], experts.down_proj[expert]


def saved_dense_names(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every non-expert tensor under the name save_pretrained gives it (Mixtral: `block_sparse_moe.gate`)."""
    rename = model.config.model_type == "mixtral"
    out = {}
    for name, tensor in model.state_dict().items():
        if ".experts." in name:
            continue
        if rename:
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[name] = tensor
    return out


def _parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    return int(size[:-2]) * units[size[-2:].upper()]


def _save_shards(state: dict[str, torch.Tensor], out: Path, max_bytes: int | None) -> None:
    """The layout save_pretrained uses: model.safetensors, or numbered shards plus an index."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
