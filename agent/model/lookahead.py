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
  guess cut a token's demand misses by 16-36% for 2-7% more reads (bench/lookahead.py). The last
  layer guesses the first layer of the next step the same way, from what followed it before: the
  head, the sampling and the first layer's attention run meanwhile, and the device would idle.
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
    def predict(self, layer: int, routed: list[int], residual: Tensor) -> tuple[int, list[int]] | None:
        """Layer `layer` routed `routed`: the layer that runs next and the experts it will want, most likely
        first (None: no guess)."""


@dataclass
class RouterGuess:
    guesses: dict[int, Guess]           # store layer L -> how to guess store layer L+1's experts

    def predict(self, layer: int, routed: list[int], residual: Tensor) -> tuple[int, list[int]] | None:
        return (layer + 1, self.guesses[layer](residual)) if layer in self.guesses else None


GUESS_AT = 0.3   # chosen on the validation traces (olmoe_code, qwen_code): fewer demand misses at no more reads


class CoActivation:
    AHEAD = 1   # the layer it guesses: the next (bench/lookahead.py tries the one after)

    def __init__(self, n_layers: int, n_experts: int) -> None:
        # [L, e at L, e' at the layer AHEAD after L (past the last layer: the next step's)]
        self.counts = np.zeros((n_layers, n_experts, n_experts), np.int32)
        self.seen = np.zeros((n_layers, n_experts), np.int32)               # [L, e at L]: times followed
        self._last: dict[int, list[int]] = {}                               # each layer's latest routing

    def predict(self, layer: int, routed: list[int], residual: Tensor) -> tuple[int, list[int]] | None:
        """The next layer (after the last: the first, of the next step) and the experts whose estimated
        chance of being routed there is at least GUESS_AT, likeliest first (ties: lower id first); None
        while no expert routed now has been followed before."""
        self.learn(layer, routed)
        seen = self.seen[layer, routed]
        known = seen > 0
        if not known.any():
            return None
        chance = (self.counts[layer, routed][known] / seen[known, None]).mean(0)   # [E]
        order = np.argsort(-chance, kind="stable")
        guess = [int(e) for e in order if chance[e] >= GUESS_AT]
        return (self.after(layer), guess) if guess else None

    def after(self, layer: int) -> int:
        """The layer guessed after `layer`: the next (AHEAD 1); after the last, the first of the next step."""
        return (layer + self.AHEAD) % len(self.counts)

    def learn(self, layer: int, routed: list[int]) -> None:
        """Count what followed the routing AHEAD layers before (the first layer's: the last of the step before)."""
        before = (layer - self.AHEAD) % len(self.counts)
        previous = self._last.get(before)
        if previous is not None:
            self.counts[before][np.ix_(previous, routed)] += 1
            self.seen[before][previous] += 1
        self._last[layer] = routed


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
        guess = self.predictor.predict(layer, routed, residual)
        if guess is None:
            return None
        self._pending[guess[0]] = set(guess[1])
        self.predicted += len(guess[1])
        return guess

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None
