"""Running the retention model for the policy: features in, one score per expert out.

Kept apart from agent.policies.flashmoe so that importing the policy registry never loads torch;
this module is imported on the first FlashMoE construction only.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numba
import numpy as np
import torch

from agent.learned.features import LayerHistory, activation_signature, expert_features, window_histogram, window_shift
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
    """ExpertTower.forward, read out against a system vector, as a compiled loop.

    Scoring ~12 experts is a few tiny matmuls: numpy and torch would spend their time in per-call
    overhead (and torch's thread pool spins when the cores are busy), not arithmetic. The loop also
    skips what is zero: the signature is bits (the embedding is a sum of the rows of the bits set)
    and about half the ReLU outputs are 0. tests/test_flashmoe_policy.py checks it equals the torch
    module."""

    def __init__(self, net: RetentionNet) -> None:
        w = {k: np.ascontiguousarray(v.detach().numpy().T, np.float32) for k, v in net.expert.state_dict().items()}
        self.weights = (w["embed.weight"], w["embed.bias"], w["mlp.0.weight"], w["mlp.0.bias"],
                        w["mlp.2.weight"], w["mlp.2.bias"])
        self.last = (w["mlp.4.weight"], w["mlp.4.bias"])  # [hidden, out], [out]

    def readout(self, system: np.ndarray) -> tuple[np.ndarray, np.float32]:
        """The last layer dotted with a system vector: score = hidden @ w + c. The system vector
        changes only with a monitoring sample, so this folds one matmul out of every scoring."""
        weight, bias = self.last
        return (weight @ system).astype(np.float32), np.float32(bias @ system)

    def scores(self, h: LayerHistory, experts: np.ndarray, readout: tuple[np.ndarray, np.float32]) -> np.ndarray:
        """Retention scores of `experts` (ids) of the layer `h` describes."""
        features = expert_features(h, experts)  # a compiled call of its own: see _tower
        out = np.empty(len(experts), np.float32)
        _tower(out, experts, features, h.bits, *self.weights, *readout)
        return out


@numba.njit(cache=True, fastmath=True)
def _tower(out, experts, features, bits, embed_w, embed_b, w0, b0, w1, b1, readout_w, readout_b):
    """out[i] = ExpertTower.forward(signature of experts[i], features[i]) dotted with the readout.
    Everything it needs comes in as arguments: numba's on-disk cache is invalidated per source
    file, so a compiled call or constant from agent.learned.features would keep its old code after
    that file changed."""
    n_bits, n_embed = embed_w.shape
    emb, h0, h1 = np.empty(n_embed, np.float32), np.empty(len(b0), np.float32), np.empty(len(b1), np.float32)
    for i, e in enumerate(experts):
        emb[:] = embed_b
        for j in range(n_bits):  # signature @ embed_w: the rows of the bits set
            if (bits[e] >> np.uint64(j)) & np.uint64(1):
                for m in range(n_embed):
                    emb[m] += embed_w[j, m]
        h0[:] = b0
        for k in range(n_embed):  # [relu(emb), features] @ w0
            if emb[k] > 0:
                _axpy(h0, emb[k], w0[k])
        for k in range(features.shape[1]):
            _axpy(h0, features[i, k], w0[n_embed + k])
        h1[:] = b1
        for k in range(len(h0)):
            if h0[k] > 0:
                _axpy(h1, h0[k], w1[k])
        score = readout_b
        for k in range(len(h1)):
            if h1[k] > 0:
                score += h1[k] * readout_w[k]
        out[i] = score


@numba.njit(cache=True, fastmath=True)
def _axpy(y, a, x):
    """y += a * x, in place (an array expression would allocate)."""
    for m in range(len(y)):
        y[m] += a * x[m]


class SharedNet:
    """One loaded network per weights file, shared by every cache partition of the process."""

    def __init__(self, net: RetentionNet) -> None:
        self.net, self.expert = net, ExpertTowerArrays(net)

    @functools.lru_cache(maxsize=64)
    def readout(self, series: tuple[tuple[float, float], ...]) -> tuple[np.ndarray, np.float32]:
        """The expert tower's readout against the system tower's output for a series; every partition
        sees the same series, so cache it."""
        x = torch.tensor([list(series) or [(0.0, 0.0)]], dtype=torch.float32)
        with torch.inference_mode():
            return self.expert.readout(self.net.system(x)[0].numpy())


@functools.lru_cache(maxsize=8)
def shared_net(path: str) -> SharedNet:
    return SharedNet(load(Path(path)))


class Scorer:
    def __init__(self, shared: SharedNet, series: Sequence[tuple[float, float]] = ()) -> None:
        self.shared = shared
        self.set_series(series)

    def set_series(self, series: Sequence[tuple[float, float]]) -> None:
        """New monitoring series: run the system tower once, reused by every scoring until the next."""
        self._readout = self.shared.readout(tuple(series))

    def prepare(self, series: Sequence[tuple[float, float]]) -> None:
        """Run the system tower for a series that set_series() will be given, so that call is a lookup."""
        self.shared.readout(tuple(series))

    def score(self, h: LayerHistory, experts: np.ndarray) -> np.ndarray:
        """Retention scores of `experts` (ids) of the layer `h` describes."""
        return self.shared.expert.scores(h, experts, self._readout)


def compile_loops(scorer: Scorer) -> None:
    """Call every compiled loop (numba) the policy runs once, on a one-expert history: a loop's first
    call in a process compiles it or loads it from numba's disk cache, 4-8 s at start-up, which must
    not happen at the first route() under the expert cache's lock. Later calls cost microseconds."""
    h = LayerHistory()
    h.observe([0])
    experts = np.zeros(1, np.int64)
    scorer.score(h, experts)
    layer_inputs(h, experts)
    window_shift(h, window_histogram(h))
