"""Running the retention model for the policy: features in, one score per expert out.

Kept apart from agent.policies.flashmoe so that importing the policy registry never loads torch;
this module is imported on the first FlashMoE construction only.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from agent.learned.features import LayerHistory, activation_signature, expert_features
from agent.learned.model import RetentionNet, load

SERIES_LEN = 16          # monitoring samples the system tower sees
REFERENCE_READ_S = 80e-6  # a typical NVMe random read: latency is fed as log2(latency / this)


def system_input(sample: Mapping[str, float]) -> tuple[float, float]:
    """One monitoring sample as the system tower's input: (log2 latency ratio, memory pressure), clipped."""
    latency = float(sample.get("read_latency_s", REFERENCE_READ_S))
    pressure = float(sample.get("mem_pressure", 0.0))
    lat = math.log2(max(latency, 1e-7) / REFERENCE_READ_S) / 4 if math.isfinite(latency) else 0.0
    return (min(max(lat, -2.0), 2.0), min(max(pressure if math.isfinite(pressure) else 0.0, 0.0), 1.0))


def layer_inputs(history: LayerHistory, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(signature, features) of `experts` of one layer: exactly what training records."""
    return activation_signature(history, experts), expert_features(history, experts)


@functools.lru_cache(maxsize=8)
def shared_net(path: str) -> RetentionNet:
    """One loaded network per weights file, shared by every cache partition of the process."""
    return load(Path(path))


class Scorer:
    def __init__(self, net: RetentionNet) -> None:
        self.net = net
        self._system: torch.Tensor | None = None

    def set_series(self, series: Sequence[tuple[float, float]]) -> None:
        """New monitoring series: recompute the system tower once, reused by every scoring."""
        x = torch.tensor([list(series) or [(0.0, 0.0)]], dtype=torch.float32)
        with torch.inference_mode():
            self._system = self.net.system(x)[0]

    def score(self, parts: Iterable[tuple[LayerHistory, np.ndarray]]) -> np.ndarray:
        """Retention scores of the given (layer history, expert ids) groups, concatenated in order."""
        if self._system is None:
            self.set_series([])
        sigs, feats = zip(*(layer_inputs(h, e) for h, e in parts))
        with torch.inference_mode():
            h = self.net.expert(torch.from_numpy(np.concatenate(sigs)), torch.from_numpy(np.concatenate(feats)))
            return (h @ self._system).numpy()
