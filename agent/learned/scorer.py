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


class ExpertTowerArrays:
    """ExpertTower.forward in numpy. Scoring ~16 experts is a few tiny matmuls: torch's per-op
    overhead and its thread pool (which spins when the cores are busy) would cost ten times the
    arithmetic. tests/test_flashmoe_policy.py checks this equals the torch module."""

    def __init__(self, net: RetentionNet) -> None:
        w = {k: v.detach().numpy().astype(np.float32) for k, v in net.expert.state_dict().items()}
        self.embed = (w["embed.weight"].T.copy(), w["embed.bias"])
        self.layers = [(w[f"mlp.{i}.weight"].T.copy(), w[f"mlp.{i}.bias"]) for i in (0, 2, 4)]

    def hidden(self, signature: np.ndarray, features: np.ndarray) -> np.ndarray:
        """The activations entering the last layer: [N, hidden]."""
        x = np.concatenate([np.maximum(signature @ self.embed[0] + self.embed[1], 0), features], axis=1)
        for weight, bias in self.layers[:-1]:
            x = np.maximum(x @ weight + bias, 0)
        return x

    def __call__(self, signature: np.ndarray, features: np.ndarray) -> np.ndarray:
        weight, bias = self.layers[-1]
        return self.hidden(signature, features) @ weight + bias  # [N, out]

    def readout(self, system: np.ndarray) -> tuple[np.ndarray, float]:
        """The last layer dotted with a system vector: score = hidden @ w + c. The system vector
        changes only with a monitoring sample, so this folds one matmul out of every scoring."""
        weight, bias = self.layers[-1]
        return weight @ system, float(bias @ system)


class SharedNet:
    """One loaded network per weights file, shared by every cache partition of the process."""

    def __init__(self, net: RetentionNet) -> None:
        self.net, self.expert = net, ExpertTowerArrays(net)

    @functools.lru_cache(maxsize=64)
    def system_vector(self, series: tuple[tuple[float, float], ...]) -> np.ndarray:
        """The system tower's output for a series; every partition sees the same series, so cache it."""
        x = torch.tensor([list(series) or [(0.0, 0.0)]], dtype=torch.float32)
        with torch.inference_mode():
            return self.net.system(x)[0].numpy()


@functools.lru_cache(maxsize=8)
def shared_net(path: str) -> SharedNet:
    return SharedNet(load(Path(path)))


class Scorer:
    def __init__(self, shared: SharedNet) -> None:
        self.shared = shared
        self.set_series(())

    def set_series(self, series: Sequence[tuple[float, float]]) -> None:
        """New monitoring series: run the system tower once, reused by every scoring until the next."""
        self._readout = self.shared.expert.readout(self.shared.system_vector(tuple(series)))

    def score(self, parts: Iterable[tuple[LayerHistory, np.ndarray]]) -> np.ndarray:
        """Retention scores of the given (layer history, expert ids) groups, concatenated in order."""
        signature, features = (np.concatenate(a) if len(a) > 1 else a[0]
                               for a in zip(*(layer_inputs(h, e) for h, e in parts)))
        weight, bias = self._readout
        return self.shared.expert.hidden(signature, features) @ weight + bias
