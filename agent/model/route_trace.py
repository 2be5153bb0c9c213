"""Trace-driven routing: recorded real routing decides each token's experts.

Random weights give no real locality (which experts a trained model picks, and how that drifts with
the text), so with a route trace every MoE layer still computes its router's softmax (compute is
unchanged) but takes the experts the trace recorded for that token and layer; the gate weights are
the router's own probabilities of those experts, renormalised as the architecture says. Every
expert read, CRC check, cache decision and matmul stays real.

A sequence is placed in the traces by its first tokens (a stable hash picks the file and the start
record), so the same prompt follows the same routing in every run and configuration; its token at
position p takes record start + p, wrapping at the file's end. A trace must fit the model: the same
number of MoE layers and top-k, and no expert id the model does not have.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from agent.model.config import MoEConfig
from agent.traces import TraceError, load


@dataclass(frozen=True)
class Placement:
    file: int       # which trace
    start: int      # the record a sequence's position 0 takes


@dataclass(frozen=True)
class RouteTrace:
    names: tuple[str, ...]
    routes: tuple[np.ndarray, ...]  # per file: int64 [records, MoE layers, k]

    @classmethod
    def load(cls, paths: Sequence[Path | str], config: MoEConfig) -> "RouteTrace":
        """Read routing traces (.jsonl decode or .npz prefill) and check that each fits `config`."""
        if not paths:
            raise TraceError("give at least one route trace file")
        routes = []
        for path in paths:
            trace = load(path)
            layers = len(config.moe_layer_ids)
            if (trace.n_layers, trace.top_k, trace.n_experts) != (layers, config.top_k, config.n_experts):
                raise TraceError(f"{path}: the trace routes {trace.n_layers} layers x top-{trace.top_k} of "
                                 f"{trace.n_experts} experts, the model has {layers} MoE layers x top-{config.top_k} "
                                 f"of {config.n_experts}; use a trace recorded from this model's architecture")
            routes.append(trace.dense().astype(np.int64))
        return cls(tuple(Path(p).name for p in paths), tuple(routes))

    def place(self, tokens: Tensor) -> Placement:
        """Where a sequence starting with `tokens` sits in the traces (stable across runs)."""
        h = zlib.crc32(tokens.to(torch.int64).numpy().tobytes())
        file = h % len(self.routes)
        return Placement(file, (h // len(self.routes)) % len(self.routes[file]))

    def experts(self, at: Placement, pos: int, n: int) -> Tensor:
        """[n, MoE layers, k] expert ids of positions pos..pos+n of a sequence placed `at`."""
        records = self.routes[at.file]
        return torch.from_numpy(records[(at.start + np.arange(pos, pos + n)) % len(records)])

    def describe(self) -> str:
        return f"routing from trace {', '.join(self.names)}"
