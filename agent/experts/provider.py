"""What the model asks of wherever routed experts live.

The model calls, per MoE layer and decode step: route() once with the experts the router chose
for the whole batch, then get() for each of them, in the order route() returned (None: as routed),
and prefetch() with its guess for the next layer. Tensors returned by get() stay valid until the
next route() of the same layer.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

from agent.experts.layout import EXPERTS, INDEX, Index, StoreError, crc32


class ExpertWeights(NamedTuple):
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor    # [I, H]
    down: torch.Tensor  # [H, I]


class ExpertProvider(Protocol):
    def route(self, layer: int, experts: Sequence[int]) -> Sequence[int] | None: ...
    def get(self, layer: int, expert: int) -> ExpertWeights: ...
    def prefetch(self, layer: int, experts: Sequence[int]) -> None: ...


def block_views(buf: torch.Tensor, index: Index) -> ExpertWeights:
    """View one block's bytes (a uint8 tensor of at least index.nbytes) as gate, up, down without a copy."""
    dtype = getattr(torch, index.dtype)
    flat = buf[: index.nbytes].view(dtype)
    n = index.hidden * index.intermediate
    return ExpertWeights(flat[:n].view(index.intermediate, index.hidden),
                         flat[n:2 * n].view(index.intermediate, index.hidden),
                         flat[2 * n:].view(index.hidden, index.intermediate))


class InMemoryExperts:
    """Every expert in RAM: the all-in-RAM reference the cached runtime is measured against."""

    def __init__(self, store_dir: Path, verify: bool = True) -> None:
        self.index = Index.load(Path(store_dir) / INDEX)
        raw = np.fromfile(Path(store_dir) / EXPERTS, dtype=np.uint8)
        self._blocks = {}
        for b in self.index.blocks:
            chunk = raw[b.offset:b.offset + self.index.nbytes]
            if len(chunk) < self.index.nbytes or (verify and crc32(chunk) != b.crc32):
                raise StoreError(f"expert block layer {b.layer} expert {b.expert} is corrupt or truncated "
                                 f"in {Path(store_dir) / EXPERTS}; re-run flashmoe-cli convert")
            self._blocks[b.layer, b.expert] = block_views(torch.from_numpy(chunk.copy()), self.index)

    def route(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self._blocks[layer, expert]

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass
