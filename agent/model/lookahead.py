"""Lookahead prefetch: guess the next MoE layer's experts, to be read while this layer computes.

Once layer L has routed, a predictor guesses layer L+1's experts, most likely first, and the guess
goes to `provider.prefetch`, which reads the likeliest while room lasts: a batched step's guess names
most of the layer (the union over its tokens), more than the partition has room to read into without
evicting an expert the guess names, so its order decides which few are read. Two predictors:
- RouterGuess (the default): layer L+1's router applied to L+1's own post-attention RMSNorm of the
  residual stream entering L's MoE (L+1's attention and L's expert output are not known yet, so this
  is the best guess available before L's experts run), ranked by how many tokens would choose each
  expert. The residual stream changes little from one layer to the next, which is what makes the
  guess useful.
- CoActivation: when a route trace imposes the routing, the router of a random-weight model cannot
  predict it. Instead, from this run's earlier steps (counted online, no future knowledge): for each
  expert L routed now, how often each expert followed it at L+1; averaged over them, that is each
  expert's chance of being routed at L+1, and the guess is every expert whose chance is at least
  GUESS_AT, likeliest first. Ranking raw co-occurrence counts instead favoured the experts routed
  most often, which are resident anyway, and read few of the rest: on OLMoE's decode traces this
  guess cut a token's demand misses by 16-36% for 2-7% more reads (bench/lookahead.py).
Accuracy: of the experts predicted for a layer, how many its real routing then used.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from torch import Tensor

Guess = Callable[[Tensor], list[int]]   # residual stream [T, D] -> a layer router's choice, most tokens first


class Predictor(Protocol):
    def predict(self, layer: int, routed: list[int], residual: Tensor) -> list[int] | None:
        """Layer `layer` routed `routed`: the experts layer+1 will want, most likely first (None: no guess)."""


@dataclass
class RouterGuess:
    guesses: dict[int, Guess]           # store layer L -> how to guess store layer L+1's experts

    def predict(self, layer: int, routed: list[int], residual: Tensor) -> list[int] | None:
        return self.guesses[layer](residual) if layer in self.guesses else None


GUESS_AT = 0.3   # chosen on the validation traces (olmoe_code, qwen_code): fewer demand misses at no more reads


class CoActivation:
    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.counts = np.zeros((n_layers, n_experts, n_experts), np.int32)  # [L, e at L, e' at L+1]
        self.seen = np.zeros((n_layers, n_experts), np.int32)               # [L, e at L]: steps with a next layer
        self._last: dict[int, list[int]] = {}                               # this step's routing so far

    def predict(self, layer: int, routed: list[int], residual: Tensor) -> list[int] | None:
        """The experts whose estimated chance of being routed at layer+1 is at least GUESS_AT, likeliest
        first (ties: lower id first); None while no expert routed now has been seen before a next layer."""
        if not self.learn(layer, routed):
            return None
        seen = self.seen[layer, routed]
        known = seen > 0
        if not known.any():
            return None
        chance = (self.counts[layer, routed][known] / seen[known, None]).mean(0)   # [E]
        order = np.argsort(-chance, kind="stable")
        return [int(e) for e in order if chance[e] >= GUESS_AT] or None

    def learn(self, layer: int, routed: list[int]) -> bool:
        """Count what followed the previous layer's routing; whether `layer` has a next layer to guess."""
        previous = self._last.get(layer - 1)
        if previous is not None:
            self.counts[layer - 1][np.ix_(previous, routed)] += 1
            self.seen[layer - 1][previous] += 1
        self._last[layer] = routed
        return layer + 1 < len(self.counts)


@dataclass
class Lookahead:
    predictor: Predictor
    enabled: bool = True                # off: no guesses (a pure demand-access run)
    predicted: int = 0
    correct: int = 0
    _pending: dict[int, set[int]] = field(default_factory=dict)

    def after_route(self, layer: int, routed: list[int], residual: Tensor) -> tuple[int, list[int]] | None:
        """Layer `layer` has routed: score the guess made for it, and return the guess for the next
        layer from `residual` as (layer, experts), or None if there is none to make."""
        self.correct += len(self._pending.pop(layer, set()) & set(routed))
        if not self.enabled:
            return None
        experts = self.predictor.predict(layer, routed, residual)
        if experts is None:
            return None
        self._pending[layer + 1] = set(experts)
        self.predicted += len(experts)
        return layer + 1, experts

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None
