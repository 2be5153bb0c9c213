"""Lookahead prefetch: guess the next MoE layer's experts while this layer's are being read.

Once layer L has routed, layer L+1's router is applied to L+1's own post-attention RMSNorm of the
residual stream entering L's MoE (L+1's attention and L's expert output are not known yet, so this
is the best guess available before L's experts run), and the union of its top-k choices goes to
`provider.prefetch`. The residual stream changes little from one layer to the next, which is what
makes the guess useful. Accuracy: of the experts predicted for a layer, how many its real routing
then used.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

Guess = Callable[[Tensor], list[int]]   # residual stream [T, D] -> the experts a layer's router would choose


@dataclass
class Lookahead:
    guesses: dict[int, Guess]           # store layer L -> how to guess store layer L+1's experts
    enabled: bool = True                # off: no guesses (a pure demand-access run)
    predicted: int = 0
    correct: int = 0
    _pending: dict[int, set[int]] = field(default_factory=dict)

    def after_route(self, layer: int, routed: list[int], residual: Tensor) -> tuple[int, list[int]] | None:
        """Layer `layer` has routed: score the guess made for it, and return the guess for the next
        layer from `residual` as (layer, experts), or None if there is none to make."""
        self.correct += len(self._pending.pop(layer, set()) & set(routed))
        if not self.enabled or layer not in self.guesses:
            return None
        experts = self.guesses[layer](residual)
        self._pending[layer + 1] = set(experts)
        self.predicted += len(experts)
        return layer + 1, experts

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None
