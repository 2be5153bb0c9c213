"""Rotary position embeddings: the tables for a step's positions, and rotating q/k heads by them.

Default RoPE for every architecture; YaRN (DeepSeek-V2-Lite's rope_scaling) as transformers 5.24
computes it (modeling_rope_utils._compute_yarn_parameters), so long-context checkpoints give the same
logits at every position.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from agent.model.config import MoEConfig, Yarn


def rope_tables(positions: Tensor, config: MoEConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, Dh] for the given absolute positions (half-split layout of the HF checkpoints)."""
    freqs = positions[:, None].float() * inv_freq(config.head_dim, config.rope_theta, config.yarn)  # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                                          # [T, Dh]
    scale = config.yarn.attention_factor if config.yarn else 1.0
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def inv_freq(dim: int, theta: float, yarn: Yarn | None) -> Tensor:
    """[Dh/2] rotation speeds. YaRN keeps the fast ones (many turns within the original length), divides
    the slow ones by its factor, and blends linearly between the two by dimension."""
    base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if yarn is None:
        return base
    low, high = (_correction_dim(turns, dim, theta, yarn.original_max_len)
                 for turns in (yarn.beta_fast, yarn.beta_slow))
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return base / yarn.factor * ramp + base * (1 - ramp)


def _correction_dim(turns: float, dim: int, theta: float, length: float) -> float:
    """The dimension whose frequency turns `turns` times over `length` positions."""
    return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))


def deinterleave(x: Tensor) -> Tensor:
    """[..., Dh] with rotary pairs adjacent (DeepSeek-V2's complex layout) -> evens then odds, the half-split
    layout apply_rope takes. Applied to both q and k it permutes their dot products' terms alike, so the
    attention scores are unchanged and nothing needs to be put back."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, Dh] rotated by the angles of its token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
