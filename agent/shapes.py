"""Random-weight Hugging Face checkpoints with the real shapes and hub tensor names of published MoE models.

No weights can be downloaded here, so real size is reached with the published config.json of each
model (SHAPES) and random bfloat16 tensors under the names the hub checkpoint uses: sharded
safetensors plus model.safetensors.index.json, exactly what `flashmoe-cli convert` reads. The tensor
names and shapes come from our own model built on the meta device (no memory), so they are the
ones convert checks. `layers` may cut a model's depth to fit the disk; the config.json then says so.

Weights are N(0, 0.02) (transformers' initializer_range), norms 1. Drawing 13 GB of normals would
take minutes, so each tensor is a slice, at a random offset, of one pool of normals drawn once;
tensors are made one at a time as their turn to be written comes, so memory stays at one tensor.
Random weights route almost every token to the same experts: real locality comes from a routing
trace (see agent/model/route_trace.py), not from these weights.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent.atomic_file import missing_parents, remove_empty
from agent.convert.checkpoint import SHARD_INDEX
from agent.convert.safetensors_io import Lazy, write_safetensors
from agent.convert.store_writer import STORE_FILES, check_outside_models, check_room, followed, foreign_names, listed
from agent.experts.layout import CONFIG, INDEX, Index, StoreError
from agent.model.config import MoEConfig

log = logging.getLogger(__name__)

# The published config.json of each model (the fields our model reads), as the hub has them.
SHAPES: dict[str, dict[str, Any]] = {
    "olmoe-1b-7b": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], vocab_size=50304,
                        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096, clip_qkv=None,
                        tie_word_embeddings=False, eos_token_id=50279, pad_token_id=1, hidden_act="silu"),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                          hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                          tie_word_embeddings=False, eos_token_id=151645, hidden_act="silu"),
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=151936,
                              hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                              intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[], use_sliding_window=False, sliding_window=32768,
                              max_window_layers=21, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=8192,
                              tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643, hidden_act="silu"),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400,
                             hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                             intermediate_size=10944, moe_intermediate_size=1408, first_k_dense_replace=1,
                             moe_layer_freq=1, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             norm_topk_prob=False, routed_scaling_factor=1.0, topk_method="greedy", n_group=1,
                             topk_group=1, scoring_func="softmax", q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000,
                             rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                               beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
                             rms_norm_eps=1e-6, max_position_embeddings=163840, attention_bias=False,
                             tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001, hidden_act="silu"),
}
SEED = 0
STD = 0.02                 # transformers' initializer_range
POOL_VALUES = 1 << 24      # 32 MiB of bfloat16 normals, sliced for every tensor
LAYERS_PER_SHARD = 4
CHECKPOINT_FILES = re.compile(r"config\.json|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors")
DEPTH = ("num_hidden_layers", "flashmoe_cut")   # what --layers changes in a shape's config.json


class ShapeError(ValueError):
    """An unknown shape name, a layer count the model does not have, or an --out holding what init-demo --shape
    did not write; the message says what is allowed."""


def shape_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The config.json of shape `name`, cut to `layers` decoder layers if given."""
    if name not in SHAPES:
        raise ShapeError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    config = {**SHAPES[name], "torch_dtype": "bfloat16"}
    full = config["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full:
            raise ShapeError(f"{name} has {full} layers; --layers must be between 1 and {full}, got {layers}")
        config |= {"num_hidden_layers": layers, "flashmoe_cut": f"{layers} of {full} layers"}
    return config


def checkpoint_tensors(config: MoEConfig) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(hub name, shape, decoder layer or None) of every tensor, in the order save_pretrained writes them.
    Dense names and shapes come from our own model on the meta device; experts are named per expert."""
    from agent.model.model import Transformer  # the model imports the expert store; keep this module light
    with torch.device("meta"):
        model = Transformer(config, provider=None)
    tensors = []
    for name, t in model.state_dict().items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        tensors.append((name if name == "lm_head.weight" else f"model.{name}", tuple(t.shape), layer))
    expert = {"gate_proj": (config.expert_dim, config.dim), "up_proj": (config.expert_dim, config.dim),
              "down_proj": (config.dim, config.expert_dim)}
    for layer in config.moe_layer_ids:
        tensors += [(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", shape, layer)
                    for e in range(config.n_experts) for proj, shape in expert.items()]
    return tensors


def _shard(hub: str, layer: int | None, n_shards: int) -> int:
    """Layers in groups of LAYERS_PER_SHARD; the embedding in the first shard, final norm and head in the last."""
    if layer is not None:
        return layer // LAYERS_PER_SHARD
    return 0 if hub == "model.embed_tokens.weight" else n_shards - 1


class _Pool:
    """bfloat16 N(0, STD) bits (uint16) drawn once; each tensor is a slice at a random offset."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        normals = rng.standard_normal(POOL_VALUES, dtype=np.float32) * np.float32(STD)
        self.bits = (normals.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the top half of a float32

    def tensor(self, shape: tuple[int, ...], name: str) -> Lazy:
        n = int(np.prod(shape))
        if name.endswith("norm.weight"):
            return Lazy("BF16", shape, lambda: np.full(n, 0x3F80, np.uint16))  # 1.0 in bfloat16
        offset = int(self.rng.integers(0, POOL_VALUES))  # drawn now: the file does not depend on write order

        def make() -> np.ndarray:
            reps = -(-(offset + n) // POOL_VALUES)
            return np.tile(self.bits, reps)[offset:offset + n] if reps > 1 else self.bits[offset:offset + n]
        return Lazy("BF16", shape, make)


def write_checkpoint(config_json: dict[str, Any], out: Path) -> Path:
    """Write a random-weight sharded bfloat16 checkpoint of this config.json in `out`; returns `out`."""
    config = MoEConfig.from_hf(config_json)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / SHARD_INDEX).unlink(missing_ok=True)   # written last: only a whole checkpoint has one (_written)
    (out / "config.json").write_text(json.dumps(config_json, indent=2))  # first: names even a partial one ours
    pool = _Pool(np.random.default_rng(SEED))
    tensors = [(hub, pool.tensor(shape, hub), layer) for hub, shape, layer in checkpoint_tensors(config)]
    n_shards = -(-config.n_layers // LAYERS_PER_SHARD)
    weight_map, total = {}, 0
    for shard in range(n_shards):
        file = f"model-{shard + 1:05d}-of-{n_shards:05d}.safetensors"
        mine = [(hub, t) for hub, t, layer in tensors if _shard(hub, layer, n_shards) == shard]
        write_safetensors(out / file, mine)
        weight_map |= {hub: file for hub, _ in mine}
        total += sum(int(np.prod(t.shape)) * 2 for _, t in mine)
        log.info("wrote %s (%d tensors)", out / file, len(mine))
    (out / SHARD_INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return out


def init_shape(config: dict[str, Any], out: Path, drop_hf: bool = False) -> Path:
    """Write a checkpoint of `config` (e.g. shape_config(name)) to out/hf and convert it with the real
    converter into out/store; returns the store. With `drop_hf` the checkpoint is deleted once every
    block of the store passed its CRC check. A store converted from the same config.json is left alone, and a
    whole checkpoint whose conversion failed (a full disk) is kept for the rerun to convert."""
    from agent.convert import convert
    from agent.experts.reader import check_blocks
    out = followed(Path(out), "--out")
    hf, store = out / "hf", out / "store"
    if _converted(store, config):
        log.info("%s already holds this model; nothing to do", store)
        return store
    check_outside_models(hf, "--out")
    _check_ours(hf, CHECKPOINT_FILES.fullmatch, config)
    _check_ours(store, STORE_FILES.__contains__, config)
    check_room(out, _least_room(config, hf), "--out", "the checkpoint with its store")
    if _written(hf, config):
        log.info("%s already holds this checkpoint; converting it", hf)
    else:
        made = missing_parents(hf)
        try:
            write_checkpoint(config, hf)
        except OSError:   # a full disk, mostly: a half-written checkpoint is of no use, a rerun writes it again
            shutil.rmtree(hf, ignore_errors=True)
            remove_empty(made)
            raise
    convert(hf, store, overwrite=True, quantize=None)   # as published: the seed-scale benches convert the int8 twin
    if drop_hf:
        log.info("checked %d blocks of %s; deleting %s", check_blocks(store), store, hf)
        shutil.rmtree(hf)
    return store


def _written(hf: Path, config: dict[str, Any]) -> bool:
    """Whether `hf` holds the whole checkpoint of `config`, kept by a run whose conversion failed."""
    try:
        return (hf / SHARD_INDEX).is_file() and json.loads((hf / CONFIG).read_text()) == config
    except (OSError, ValueError):
        return False


def _least_room(config: dict[str, Any], hf: Path) -> int:
    """The least room writing the checkpoint of `config` and converting it takes: its tensors twice (the store
    holds them in the same dtype), less what an earlier checkpoint in `hf`, written over, takes already."""
    tensors = checkpoint_tensors(MoEConfig.from_hf(config))
    earlier = sum(f.stat().st_size for f in hf.iterdir() if f.is_file()) if hf.is_dir() else 0
    return 2 * sum(int(np.prod(shape)) * 2 for _, shape, _ in tensors) - earlier


def _check_ours(directory: Path, ours: Callable[[str], object], config: dict[str, Any]) -> None:
    """init-demo --shape rewrites (and --drop-hf deletes) only what it wrote: files it names so, under a
    config.json of a shape. A user's checkpoint or store, or their files beside ours, are never lost."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return
    others = foreign_names(directory, ours)
    if others:
        raise ShapeError(f"{directory} holds {listed(others)}, which init-demo --shape did not write; "
                         f"choose another --out or remove it yourself")
    if not _a_shape(directory / CONFIG, config):
        raise ShapeError(f"{directory} holds a model init-demo --shape did not write (its config.json is no "
                         f"shape's); choose another --out or remove it yourself")


def _a_shape(config_json: Path, config: dict[str, Any]) -> bool:
    """The config.json of `config` or of a shape, at any depth."""
    try:
        found = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return False
    shapes = [config] + [shape_config(name) for name in SHAPES]
    return isinstance(found, dict) and _depthless(found) in map(_depthless, shapes)


def _depthless(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in DEPTH}


def _converted(store: Path, config: dict[str, Any]) -> bool:
    try:
        Index.load(store / INDEX)
        return json.loads((store / CONFIG).read_text()) == config
    except (OSError, ValueError, StoreError):
        return False
