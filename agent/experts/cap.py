"""The expert cache's cap in bytes: what a user may write for it, and the range a cache accepts.

parse_cap reads "300000000", "300MB", "1.5GiB" or "25%" (of all expert bytes); cap_bounds gives
the range ExpertCache accepts, from one layer's working set of slots up to MAX_MEMORY_SHARE of the
memory this process may use (physical memory or the tightest cgroup limit on it and its ancestors)
less what the model itself keeps in RAM (resident_bytes): slots, dense weights and KV cache
together stay within the share.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from agent.experts.layout import CONFIG, DENSE, Index
from agent.model.config import MoEConfig
from agent.residency import Residency
from machine.cgroup import memory_limit

MAX_MEMORY_SHARE = 0.7        # of physical memory or of the cgroup limit, whichever is smaller
KV_BUDGET_TOKENS = 4096       # KV cache positions counted against the share (all sequences together;
                              # serve --kv-budget, which its scheduler then holds to)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_cap(text: str | int, total_expert_bytes: int) -> int:
    """A cache cap in bytes from "300000000", "300MB", "1.5GiB" or "25%" (of all expert bytes)."""
    s = str(text).strip().lower().replace(" ", "")
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise ValueError(f"cache cap {text!r}: a percentage must be in (0, 100]")
        return int(total_expert_bytes * pct / 100)
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cache cap {text!r} is not understood; give bytes (300000000), a size (300MB, 1.5GiB) "
                         f"or a share of expert bytes (25%)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def memory_limit_bytes() -> int:
    """The smaller of physical memory and the cgroup memory limit (read afresh: it may change). OSError
    if the limit cannot be read now: never mistake that for no limit."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(physical, memory_limit() or physical)


def resident_bytes(store_dir: Path, index: Index, kv_positions: int = KV_BUDGET_TOKENS) -> int:
    """RAM the model keeps besides the expert slots: its dense weights (dense.safetensors is loaded
    whole) and a KV cache of `kv_positions` positions in the model's dtype. A store of experts
    alone (no dense weights: no model will run on it) keeps nothing else."""
    dense = Path(store_dir) / DENSE
    if not dense.exists():
        return 0
    config = MoEConfig.from_file(Path(store_dir) / CONFIG)
    heads, k_dim, v_dim = config.kv_cache_shape
    kv_per_token = config.n_layers * heads * (k_dim + v_dim) * index.itemsize
    return dense.stat().st_size + kv_positions * kv_per_token


def cap_bounds(index: Index, min_per_layer: int, scope: str = "layer", reserved: int = 0,
               memory: int | None = None) -> tuple[int, int]:
    """Allowed cache cap in bytes: one layer's working set of slots (Residency.min_capacity), up to
    70% of available `memory` (default: memory_limit_bytes(), read now) less `reserved` (resident_bytes:
    what the model itself keeps in RAM)."""
    floor = Residency.min_capacity(index.n_layers, min_per_layer, scope) * index.slot_bytes
    return floor, int((memory_limit_bytes() if memory is None else memory) * MAX_MEMORY_SHARE) - reserved
