"""What the model asks of wherever routed experts live.

The model calls, per MoE layer and decode step: route() once with the experts the router chose
for the whole batch, then get() for each of them, in the order route() returned (None: as routed),
and prefetch() with its guess for the next layer, most likely first. Tensors returned by get() stay
valid until the next route() of the same layer.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from agent.bf16_matvec import linear
from agent.experts.layout import EXPERTS, INDEX, Index, StoreError, crc32
from agent.experts.quant import Int4Expert, Int8Expert


class ExpertWeights(NamedTuple):
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor    # [I, H]
    down: torch.Tensor  # [H, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The expert's SwiGLU: x [t, H] -> [t, H]."""
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)


Expert = ExpertWeights | Int8Expert | Int4Expert  # what get() returns: called on the tokens routed to it


class ExpertProvider(Protocol):
    def route(self, layer: int, experts: Sequence[int]) -> Sequence[int] | None: ...
    def get(self, layer: int, expert: int) -> Expert: ...
    def done(self, layer: int, expert: int) -> None: ...   # the calling thread no longer uses what get() gave it
    def prefetch(self, layer: int, experts: Sequence[int]) -> None: ...


def block_views(buf: torch.Tensor, index: Index, int8_activations: bool = True) -> Expert:
    """View one block's bytes (a uint8 tensor of at least index.nbytes) as an expert without a copy;
    `int8_activations`: whether an int8 expert quantizes bf16 activations too (W8A8, agent/experts/quant.py)."""
    if index.quant == "int8":
        return Int8Expert.view(buf, index, int8_activations)
    if index.quant == "int4":
        return Int4Expert.view(buf, index)
    return ExpertWeights(*(part.view(buf) for part in index.parts))


class InMemoryExperts:
    """Every expert in RAM: the all-in-RAM reference the cached runtime is measured against."""

    def __init__(self, store_dir: Path, verify: bool = True, int8_activations: bool = True) -> None:
        self.index = Index.load(Path(store_dir) / INDEX)
        raw = np.fromfile(Path(store_dir) / EXPERTS, dtype=np.uint8)
        self._blocks = {}
        for b in self.index.blocks:
            chunk = raw[b.offset:b.offset + self.index.nbytes]
            if len(chunk) < self.index.nbytes or (verify and crc32(chunk) != b.crc32):
                raise StoreError(f"expert block layer {b.layer} expert {b.expert} is corrupt or truncated "
                                 f"in {Path(store_dir) / EXPERTS}; re-run flashmoe-cli convert")
            self._blocks[b.layer, b.expert] = block_views(torch.from_numpy(chunk.copy()), self.index, int8_activations)

    def route(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def get(self, layer: int, expert: int) -> Expert:
        return self._blocks[layer, expert]

    def done(self, layer: int, expert: int) -> None:
        pass

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass
