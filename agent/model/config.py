"""MoEConfig: one dataclass for every supported decoder, built from a Hugging Face config.json.

The architectures differ only in a handful of switches (q/k norms, biases, the router's
renormalisation and scale, shared experts, sliding windows, dense-MLP layers, DeepSeek-V2's
multi-head latent attention), so one config and one model cover them all. Defaults for optional
fields are transformers 5.24's, so a config.json that omits them means what it means to
transformers; shape fields are required.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = ("olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2")


class ConfigError(ValueError):
    """config.json cannot be run by this model; the message names the field or architecture."""


# Shape fields every config.json must state (no sensible default exists).
_REQUIRED = {
    "olmoe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "num_experts_per_tok"),
    "qwen3_moe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "moe_intermediate_size", "num_experts_per_tok"),
    "qwen2_moe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok"),
    "mixtral": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_experts_per_tok"),
    "deepseek_v2": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "moe_intermediate_size", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim"),
}

# transformers 5.24 defaults of the optional fields we read (configuration_<arch>.py).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "olmoe": dict(num_key_value_heads=None, rms_norm_eps=1e-5, rope_theta=10000.0, norm_topk_prob=False,
                  tie_word_embeddings=False, attention_bias=False, clip_qkv=None, max_position_embeddings=4096),
    "qwen3_moe": dict(num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False,
                      tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                      sliding_window=4096, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=6144,
                      max_position_embeddings=32768),
    "qwen2_moe": dict(num_key_value_heads=16, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False,
                      tie_word_embeddings=False, qkv_bias=True, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=5632,
                      max_position_embeddings=32768),
    "mixtral": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
                    sliding_window=None, max_position_embeddings=131072),
    "deepseek_v2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False, tie_word_embeddings=False,
                        attention_bias=False, mlp_bias=False, max_position_embeddings=2048, first_k_dense_replace=0,
                        q_lora_rank=1536, n_shared_experts=2, routed_scaling_factor=1.0, topk_method="greedy",
                        scoring_func="softmax", moe_layer_freq=1),
}


@dataclass(frozen=True)
class _Kind:
    """What a config.json field must be."""
    what: str                     # for the error: "it must be <what>"
    ok: Callable[[Any], bool]


# The kind of every field we read, so a wrong type is a one-line ConfigError rather than a traceback
# deep in the model (a field not listed here is not read). null is accepted only where transformers
# allows it (_NULLABLE); json.loads turns NaN and Infinity into floats, so numbers must be finite.
_POSITIVE_INT = _Kind("a positive integer", lambda v: type(v) is int and v > 0)
_LAYER_COUNT = _Kind("an integer from 1 to 65536", lambda v: type(v) is int and 0 < v <= 1 << 16)  # sizes tuples
_COUNT = _Kind("a non-negative integer", lambda v: type(v) is int and v >= 0)
_POSITIVE_NUMBER = _Kind("a positive finite number",
                         lambda v: type(v) in (int, float) and math.isfinite(v) and v > 0)
_BOOL = _Kind("true or false", lambda v: type(v) is bool)
_STRING = _Kind("a string", lambda v: type(v) is str)
_OBJECT = _Kind("a JSON object", lambda v: type(v) is dict)
_COUNTS = _Kind("a list of non-negative integers", lambda v: type(v) is list and all(_COUNT.ok(x) for x in v))
_TOKEN_IDS = _Kind("a token id or a list of them", lambda v: _COUNT.ok(v) or _COUNTS.ok(v))
_STRINGS = _Kind("a list of strings", lambda v: type(v) is list and all(type(x) is str for x in v))
_FIELDS: dict[str, _Kind] = {
    "num_hidden_layers": _LAYER_COUNT,
    **dict.fromkeys(("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "num_experts", "num_local_experts", "num_experts_per_tok", "decoder_sparse_step",
                     "max_position_embeddings", "n_routed_experts", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_layer_freq",
                     "original_max_position_embeddings"), _POSITIVE_INT),
    # Qwen2-MoE writes sliding_window 0 when off
    **dict.fromkeys(("max_window_layers", "sliding_window", "first_k_dense_replace", "n_shared_experts"), _COUNT),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "clip_qkv", "routed_scaling_factor"), _POSITIVE_NUMBER),
    **dict.fromkeys(("norm_topk_prob", "tie_word_embeddings", "attention_bias", "qkv_bias", "use_sliding_window",
                     "mlp_bias"), _BOOL),
    **dict.fromkeys(("hidden_act", "topk_method", "scoring_func"), _STRING),
    "mlp_only_layers": _COUNTS, "eos_token_id": _TOKEN_IDS, "layer_types": _STRINGS,
    "rope_parameters": _OBJECT, "rope_scaling": _OBJECT,
}
_NULLABLE = {"num_key_value_heads", "head_dim", "clip_qkv", "sliding_window", "eos_token_id", "mlp_only_layers",
             "layer_types", "rope_parameters", "rope_scaling", "num_experts", "num_local_experts",
             "q_lora_rank"}


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE: frequencies blended between interpolated (/factor) and original by a ramp over the
    dimensions, cos/sin scaled by attention_factor; DeepSeek also scales its softmax by softmax_scale."""
    factor: float
    original_max_len: float
    beta_fast: float
    beta_slow: float
    attention_factor: float
    softmax_scale: float            # yarn_mscale(factor, mscale_all_dim) ** 2, 1 without mscale_all_dim
    truncate: bool


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2's multi-head latent attention: q (optionally through a rank-q_lora_rank bottleneck) and
    one shared latent of kv_lora_rank from which every head's key and value are expanded; each q/k head
    is a part without RoPE (nope_dim) then a rotary part (rope_dim, the model's head_dim)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int


@dataclass(frozen=True)
class MoEConfig:
    arch: str                       # Hugging Face model_type
    vocab_size: int
    dim: int                        # hidden_size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int                   # per q/k head; MLA: its rotary part only (as transformers has it)
    n_experts: int
    top_k: int
    expert_dim: int                 # intermediate size of one routed expert
    norm_topk_prob: bool            # renormalise the top-k softmax weights to sum to 1
    rms_eps: float
    rope_theta: float
    routed_scale: float = 1.0       # DeepSeek-V2 multiplies the routed experts' weights by this
    expert_groups: tuple[int, int] | None = None  # DeepSeek-V2 group_limited_greedy: (n_group, topk_group)
    qk_norm: str | None = None      # "full": RMSNorm over the whole q/k projection (OLMoE); "head": per head (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None   # OLMoE clamps q, k, v to [-clip, clip]
    shared_expert_dim: int = 0      # Qwen2-MoE: one always-on expert scaled by sigmoid(shared_expert_gate(x))
    shared_experts_dim: int = 0     # DeepSeek-V2: n_shared always-on experts as one ungated MLP of this size
    mla: MLAConfig | None = None
    yarn: Yarn | None = None        # DeepSeek-V2-Lite's RoPE scaling (agent/model/rope.py)
    dense_dim: int = 0              # intermediate size of dense-MLP layers (Qwen mlp_only_layers / sparse step)
    moe_layers: tuple[bool, ...] = ()        # per layer: routed experts (True) or a dense MLP (False)
    sliding_window: tuple[int | None, ...] = ()  # per layer: attend to the last N positions, or None for all
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    eos_token_id: int | None = None

    @property
    def k_head_dim(self) -> int:
        return self.mla.nope_dim + self.mla.rope_dim if self.mla else self.head_dim

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(heads, key width, value width) a KV cache holds per token and layer; MLA caches one latent
        (kv_lora_rank) and one rotary key (rope_dim) from which every head's key and value are made."""
        if self.mla:
            return 1, self.mla.kv_lora_rank, self.mla.rope_dim
        return self.n_kv_heads, self.head_dim, self.head_dim

    @property
    def moe_layer_ids(self) -> list[int]:
        """Decoder layers with routed experts; the i-th of them is expert-store layer i."""
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "MoEConfig":
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json holds a JSON {_json_kind(hf)}, not an object; pass the checkpoint's own "
                              "config.json")
        arch = hf.get("model_type")
        if arch not in SUPPORTED:
            raise ConfigError(f"model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")
        missing = [k for k in _REQUIRED[arch] if hf.get(k) is None]
        if arch == "deepseek_v2" and hf.get("n_routed_experts") is None:
            missing.append("n_routed_experts")
        elif arch != "deepseek_v2" and hf.get("num_experts") is None and hf.get("num_local_experts") is None:
            missing.append("num_experts (or num_local_experts)")
        if missing:
            raise ConfigError(f"{arch} config.json is missing {', '.join(missing)}; "
                              "pass the checkpoint's own config.json")
        c = {**_DEFAULTS[arch], **hf}
        _check_fields(arch, c)
        if c.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {c['hidden_act']!r} is not supported; only silu (SwiGLU experts)")
        n_layers, n_heads = c["num_hidden_layers"], c["num_attention_heads"]
        mla = _latent_attention(c) if arch == "deepseek_v2" else None
        head_dim = mla.rope_dim if mla else c.get("head_dim") or c["hidden_size"] // n_heads
        deepseek = arch == "deepseek_v2"
        rope_theta, yarn = _rope(arch, c)
        return cls(
            arch=arch, vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_heads if mla else c["num_key_value_heads"] or n_heads, head_dim=head_dim,
            n_experts=_n_experts(arch, c), top_k=c["num_experts_per_tok"],
            expert_dim=c["intermediate_size" if arch in ("olmoe", "mixtral") else "moe_intermediate_size"],
            norm_topk_prob=True if arch == "mixtral" else bool(c["norm_topk_prob"]),
            routed_scale=float(c["routed_scaling_factor"]) if deepseek else 1.0,
            expert_groups=_expert_groups(c) if deepseek else None,
            rms_eps=float(c["rms_norm_eps"]), rope_theta=rope_theta, yarn=yarn,
            qk_norm={"olmoe": "full", "qwen3_moe": "head"}.get(arch),
            qkv_bias=bool(c.get("qkv_bias") or c.get("attention_bias")), o_bias=bool(c.get("attention_bias")),
            clip_qkv=c.get("clip_qkv"),
            shared_expert_dim=c["shared_expert_intermediate_size"] if arch == "qwen2_moe" else 0,
            shared_experts_dim=c["n_shared_experts"] * c["moe_intermediate_size"] if deepseek else 0,
            mla=mla, dense_dim=c["intermediate_size"] if arch.startswith("qwen") or deepseek else 0,
            moe_layers=_moe_layers(arch, c), sliding_window=_sliding_windows(arch, c),
            tie_embeddings=bool(c["tie_word_embeddings"]), max_seq_len=int(c["max_position_embeddings"]),
            eos_token_id=_first(c.get("eos_token_id")),
        )

    @classmethod
    def from_file(cls, path: Path) -> "MoEConfig":
        try:
            hf = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} not found; point --model at a directory written by "
                              "flashmoe-cli convert") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf(hf)


def _check_fields(arch: str, c: dict[str, Any]) -> None:
    """Each field has its type, and the counts agree: top-k within the experts, heads in whole KV groups."""
    for key, kind in _FIELDS.items():
        value = c.get(key)
        if key in c and not (kind.ok(value) or (value is None and key in _NULLABLE)):
            raise ConfigError(f"{arch} config.json has {key}={_show(value)}; it must be {kind.what}")
    n_experts = _n_experts(arch, c)
    if c["num_experts_per_tok"] > n_experts:
        raise ConfigError(f"{arch} config.json routes each token to num_experts_per_tok={c['num_experts_per_tok']} "
                          f"experts but has only {n_experts}; the config is wrong")
    n_kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    if c["num_attention_heads"] % n_kv_heads:
        raise ConfigError(f"{arch} config.json has num_attention_heads={c['num_attention_heads']}, not a multiple "
                          f"of num_key_value_heads={n_kv_heads}; the config is wrong")
    if c.get("layer_types") is not None and len(c["layer_types"]) != c["num_hidden_layers"]:
        raise ConfigError(f"{arch} config.json has {len(c['layer_types'])} layer_types for "
                          f"num_hidden_layers={c['num_hidden_layers']}; the config is wrong")


def _n_experts(arch: str, c: dict[str, Any]) -> int:
    return c["n_routed_experts"] if arch == "deepseek_v2" else c.get("num_experts") or c["num_local_experts"]


def _latent_attention(c: dict[str, Any]) -> MLAConfig:
    """DeepSeek-V2's attention and routing switches; those we do not run are refused by name."""
    refuse = {"topk_method": c["topk_method"] not in ("greedy", "group_limited_greedy"),
              "scoring_func": c["scoring_func"] != "softmax",
              # transformers' DeepseekV2 ignores norm_topk_prob, DeepSeek's own code applies it: ambiguous
              "norm_topk_prob": c["norm_topk_prob"], "moe_layer_freq": c["moe_layer_freq"] != 1,
              "mlp_bias": c["mlp_bias"], "attention_bias": c["attention_bias"],
              "qk_rope_head_dim": c["qk_rope_head_dim"] % 2 == 1}
    bad = [k for k, no in refuse.items() if no]
    if bad:
        raise ConfigError(f"deepseek_v2 config.json has {', '.join(f'{k}={_show(c[k])}' for k in bad)}, which "
                          "flashmoe does not run; supported: topk_method greedy or group_limited_greedy, "
                          "scoring_func softmax, norm_topk_prob false, moe_layer_freq 1, no MLP or attention "
                          "bias, an even qk_rope_head_dim (DeepSeek-V2 and V2-Lite's settings)")
    return MLAConfig(c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"])


def _expert_groups(c: dict[str, Any]) -> tuple[int, int] | None:
    """group_limited_greedy: top-k only among the experts of the topk_group groups (of n_group equal ones)
    whose best expert scores highest."""
    if c["topk_method"] != "group_limited_greedy":
        return None  # transformers ignores n_group and topk_group then
    n_group, topk_group = c.get("n_group"), c.get("topk_group")
    n_experts, top_k = c["n_routed_experts"], c["num_experts_per_tok"]
    if not (_POSITIVE_INT.ok(n_group) and _POSITIVE_INT.ok(topk_group) and topk_group <= n_group
            and n_experts % n_group == 0 and top_k <= topk_group * n_experts // n_group):
        raise ConfigError(f"deepseek_v2 config.json has topk_method group_limited_greedy with "
                          f"n_group={_show(n_group)}, topk_group={_show(topk_group)}; n_group must divide "
                          f"n_routed_experts={n_experts} and topk_group groups (at most n_group) must hold "
                          f"num_experts_per_tok={top_k} experts")
    return n_group, topk_group


def _show(value: Any, limit: int = 40) -> str:
    """A config value as JSON, cut short so the error stays one line."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _rope(arch: str, c: dict[str, Any]) -> tuple[float, Yarn | None]:
    """transformers 5 writes rope_parameters; older config.json files have rope_theta / rope_scaling."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", c["rope_theta"])
    if not _POSITIVE_NUMBER.ok(theta):
        raise ConfigError(f"config.json has rope_theta={_show(theta)}; it must be {_POSITIVE_NUMBER.what}")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn" or arch != "deepseek_v2":
        raise ConfigError(f"{arch} rope_type {rope_type!r} is not supported; only the default RoPE "
                          "(and yarn for deepseek_v2)")
    return float(theta), _yarn(params, c)


def _yarn(params: dict[str, Any], c: dict[str, Any]) -> Yarn:
    """YaRN as transformers 5.24 reads it (modeling_rope_utils._compute_yarn_parameters): a missing factor is
    max_position_embeddings over the original length, a top-level original_max_position_embeddings wins."""
    for key in ("factor", "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow",
                "original_max_position_embeddings"):
        if params.get(key) is not None and not _POSITIVE_NUMBER.ok(params[key]):
            raise ConfigError(f"config.json's rope yarn {key}={_show(params[key])}; it must be {_POSITIVE_NUMBER.what}")
    original = (c.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or c["max_position_embeddings"])
    factor = params.get("factor") or c["max_position_embeddings"] / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor") or (
        yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
        else yarn_mscale(factor))
    return Yarn(float(factor), float(original), float(params.get("beta_fast") or 32),
                float(params.get("beta_slow") or 1), float(attention_factor),
                yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0,
                bool(params.get("truncate", True)))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _moe_layers(arch: str, c: dict[str, Any]) -> tuple[bool, ...]:
    n = c["num_hidden_layers"]
    if arch == "deepseek_v2":
        return tuple(i >= c["first_k_dense_replace"] for i in range(n))
    if not arch.startswith("qwen"):
        return (True,) * n
    step, dense = c["decoder_sparse_step"], set(c["mlp_only_layers"] or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def _sliding_windows(arch: str, c: dict[str, Any]) -> tuple[int | None, ...]:
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    if arch == "mixtral":
        return (window,) * n
    if arch == "qwen3_moe":
        return (window if c["use_sliding_window"] else None,) * n
    if arch == "qwen2_moe":
        types = c.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < c["max_window_layers"] and c["use_sliding_window"]
            else "full_attention" for i in range(n)]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * n


def _first(token_id: int | list[int] | None) -> int | None:
    """eos_token_id may be one id or a list of them; generation stops on the first."""
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id
