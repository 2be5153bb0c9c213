"""Generation from small named steps: prefill, decode_one_token, sample (as in gpt-fast).

The prompt is prefilled in chunks of `prefill_chunk` tokens, one model step each (None: the whole
prompt in one step, whose routing reaches the provider as one union per layer; 1: token by token,
so every step routes exactly one token). Each further token is one decode step; the last sampled
token needs no forward pass, so N new tokens take N-1 decode steps after the prefill.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from agent.model.model import Sequence, Transformer


@dataclass
class Generation:
    token_ids: list[int]      # new tokens only
    prefill_s: float          # wall time of the prefill step
    decode_s: float           # wall time of the decode steps (one per new token after the first)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        total = self.prefill_s + self.decode_s
        return len(self.token_ids) / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps per second: the steady-state speed, prefill excluded."""
        return (len(self.token_ids) - 1) / self.decode_s if self.decode_s > 0 else 0.0


def prefill(model: Transformer, seq: Sequence, prompt_ids: Tensor, chunk: int | None = None,
            on_step: Callable[[], None] | None = None) -> Tensor:
    """Run the prompt [n] in steps of `chunk` tokens (None: one step); return the last token's logits."""
    size = chunk or len(prompt_ids)
    for start in range(0, len(prompt_ids), size):
        logits = model.step([(seq, prompt_ids[start:start + size])])[0]
        _notify(on_step)
    return logits


def decode_one_token(model: Transformer, seq: Sequence, token: int) -> Tensor:
    return model.step([(seq, torch.tensor([token]))])[0]


def sample(logits: Tensor, greedy: bool, temperature: float = 1.0, generator: torch.Generator | None = None,
           top_p: float = 1.0) -> int:
    """argmax when greedy, else a draw from softmax(logits / temperature) restricted to its nucleus: the
    most likely tokens whose probabilities add up to top_p (the first to reach it included)."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    # from the top and by a temperature the logits' dtype can hold: a tiny one then gives -inf (no mass), not inf or 0/0
    scaled = (logits - logits.max()) / max(temperature, torch.finfo(logits.dtype).tiny)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ranked, order = probs.sort(descending=True)
        kept = ranked.cumsum(-1) - ranked < top_p  # the mass before each token is under top_p
        kept[0] = True   # the first always: a top_p below float32's least (1e-46) compared 0 < 0
        probs = torch.zeros_like(probs).scatter(-1, order[kept], ranked[kept])
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, greedy: bool = True,
             temperature: float = 1.0, seed: int = 0, stop_ids: Collection[int] = (),
             prefill_chunk: int | None = None, on_step: Callable[[], None] | None = None) -> Generation:
    """Generate up to max_new_tokens after prompt_ids; on_step runs after every model step."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"the prompt ({len(prompt_ids)} tokens) and max_new_tokens ({max_new_tokens}) exceed the "
                         f"model's context of {model.config.max_seq_len} tokens; shorten one of them")
    for t in prompt_ids:
        if not 0 <= t < model.config.vocab_size:
            raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {model.config.vocab_size})")
    generator = torch.Generator().manual_seed(seed)
    seq = model.new_sequence(len(prompt_ids) + max_new_tokens)
    start = time.perf_counter()
    logits = prefill(model, seq, torch.tensor(prompt_ids), prefill_chunk, on_step)
    prefill_s = time.perf_counter() - start
    tokens = [sample(logits, greedy, temperature, generator)]
    start = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        logits = decode_one_token(model, seq, tokens[-1])
        _notify(on_step)
        tokens.append(sample(logits, greedy, temperature, generator))
    return Generation(tokens, prefill_s, time.perf_counter() - start)


def _notify(on_step: Callable[[], None] | None) -> None:
    if on_step is not None:
        on_step()
