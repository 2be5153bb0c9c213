"""Running the routed experts: a step's routing goes to the provider (the expert cache) as one union
per layer, and each expert's weights come from it, in the order it asks for.

This is where the expert cache plugs into the model, kept apart from the routing itself (the router
is a module of the model), as gpt-fast's Mixtral separates them.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from agent.experts.provider import ExpertProvider
from agent.model.lookahead import Lookahead
from agent.model.profile import Profile
from agent.workers import Workers


@dataclass
class Routing:
    weights: Tensor  # [T, k] gate weight of each chosen expert
    ids: Tensor      # [T, k] chosen expert ids

    @cached_property
    def assignments(self) -> dict[int, tuple[Tensor, Tensor]]:
        """expert -> (tokens that chose it, at which of their k ranks), experts ascending."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for t, row in enumerate(self.ids.tolist()):
            for rank, e in enumerate(row):
                groups.setdefault(e, ([], []))[0].append(t)
                groups[e][1].append(rank)
        return {e: (torch.tensor(groups[e][0]), torch.tensor(groups[e][1])) for e in sorted(groups)}

    @property
    def experts(self) -> list[int]:
        """The union over the step's tokens, ascending: what the provider is routed."""
        return list(self.assignments)

    @property
    def ranked(self) -> list[int]:
        """The union, most tokens first (ties: the larger summed gate weight): a guess's order."""
        ids = self.ids.flatten()
        tokens = torch.bincount(ids).tolist()                                                    # [max id + 1]
        weight = torch.zeros(len(tokens)).index_add_(0, ids, self.weights.flatten().float()).tolist()
        return sorted(self.experts, key=lambda e: (-tokens[e], -weight[e]))


@dataclass
class RoutedExperts:
    provider: ExpertProvider
    lookahead: Lookahead
    profile: Profile
    workers: Workers | None = None   # a step's experts run on them at once

    def __call__(self, layer: int, h: Tensor, routing: Routing, residual: Tensor) -> Tensor:
        """Route the step's union to the provider, let the lookahead guess the next layer from
        `residual`, then run the experts on h [T, D] in the order the provider answered."""
        experts = routing.experts
        with self.profile.phase("route"):
            order = self.provider.route(layer, experts) or experts  # a cache may answer the order it wants
        with self.profile.phase("router"):
            guess = self.lookahead.after_route(layer, experts, residual)
        if guess is not None:
            with self.profile.phase("route"):
                self.provider.prefetch(*guess)
        return run_experts(h, routing, self.provider, layer, order, self.profile, self.workers)


def run_experts(h: Tensor, routing: Routing, provider: ExpertProvider, layer: int, order: Sequence[int],
                profile: Profile, workers: Workers | None = None) -> Tensor:
    """Sum over each token's chosen experts of gate weight x SwiGLU(expert weights from the provider).

    Experts are fetched in `order` (the provider's choice), on `workers` at once (each takes the next
    expert when it is free, and tells the provider when it is done with it); their outputs are summed
    in ascending expert order, so the result depends neither on what the cache held nor on which worker
    computed what. A step of more than one token may be larger than the cache's partition, whose window
    then slides on with get(): its workers ask for their experts in `order`, one after another, as one
    thread would (an expert taken but not yet asked for must not be passed by the window). A one-token
    step always fits (the cap holds top-k experts per partition), so its workers ask at once.
    The profile is the model thread's: its own waits and matmuls, and its wait for the other workers
    at the end counted as expert matmuls."""
    # index_select / index_put_ rather than h[tok] / index_add_: the latter cost ~1 ms a call on a busy CPU.
    outputs: dict[int, Tensor] = {}
    model_thread, assignments = threading.get_ident(), routing.assignments   # computed once, before any worker
    turns = InOrder() if h.shape[0] > 1 else None

    def one(item: tuple[int, int]) -> None:
        i, e = item
        timed = threading.get_ident() == model_thread
        tok, rank = assignments[e]
        turn = turns.turn(i) if turns else nullcontext(True)
        try:
            with profile.phase("wait") if timed else nullcontext(), turn as mine:
                if not mine:
                    return                                             # a worker failed: the step raises its error
                expert = provider.get(layer, e)                        # SwiGLU of its weights, plain or int8
            with profile.phase("experts") if timed else nullcontext():
                outputs[e] = expert(h.index_select(0, tok)) * routing.weights[tok, rank, None]  # [t, D]
        except BaseException:
            if turns:
                turns.abort()   # the workers stop taking experts: one taken and dropped would never have its turn
            raise
        finally:
            provider.done(layer, e)

    if workers is None or workers.workers == 1:
        for item in enumerate(order):
            one(item)
    else:
        before, start = profile.seconds["wait"] + profile.seconds["experts"], time.perf_counter()
        workers.each(enumerate(order), one)
        joined = time.perf_counter() - start - (profile.seconds["wait"] + profile.seconds["experts"] - before)
        profile.seconds["experts"] += joined
    with profile.phase("experts"):
        out = torch.zeros_like(h)                                      # [T, D]
        for e in sorted(outputs):
            out.index_put_((routing.assignments[e][0],), outputs[e], accumulate=True)
    return out


class InOrder:
    """Lets the callers of turn(i) through one at a time, in the order of i = 0, 1, 2, ... whichever thread
    comes first (`with turn(i) as mine`: mine is True); a turn that raises still passes on. After abort()
    every turn still waiting is given up (mine is False)."""

    def __init__(self) -> None:
        self._next, self._aborted = 0, False
        self._changed = threading.Condition()

    def abort(self) -> None:
        with self._changed:
            self._aborted = True
            self._changed.notify_all()

    @contextmanager
    def turn(self, i: int) -> Iterator[bool]:
        with self._changed:
            self._changed.wait_for(lambda: self._next == i or self._aborted)
            mine = self._next == i
        if not mine:
            yield False
            return
        try:
            yield True
        finally:
            with self._changed:
                self._next += 1
                self._changed.notify_all()
