"""sample(): greedy, temperature and the top_p nucleus."""
from __future__ import annotations

import torch

from agent.model.generation import sample

LOGITS = torch.tensor([1.0, 3.0, 2.9, 0.5, 2.8])  # token 1 is the argmax with about a third of the mass


def draws(top_p: float, n: int = 300, seed: int = 7) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [sample(LOGITS, greedy=False, generator=generator, top_p=top_p) for _ in range(n)]


def test_a_small_top_p_always_draws_the_argmax():
    assert set(draws(0.01)) == {1}
    assert set(draws(1e-46)) == set(draws(5e-324)) == {1}  # below float32's least: no token was kept (a 500)
    assert set(draws(0.3)) == {1}  # the argmax alone reaches it


def test_top_p_keeps_the_tokens_up_to_the_first_that_reaches_it():
    assert set(draws(0.5)) == {1, 2}
    assert set(draws(0.9)) == {1, 2, 4}


def test_top_p_one_draws_as_plain_sampling():
    generator = torch.Generator().manual_seed(7)
    plain = [int(torch.multinomial(torch.softmax(LOGITS, -1), 1, generator=generator)) for _ in range(300)]
    assert draws(1.0) == plain and set(plain) == {0, 1, 2, 3, 4}


def test_a_tiny_temperature_draws_the_argmax():
    """logits / 1e-300 overflowed to inf, and softmax made NaN of it (a 500 from the agent)."""
    generator = torch.Generator().manual_seed(7)
    assert {sample(LOGITS, greedy=False, temperature=t, generator=generator) for t in (1e-300, 5e-324, 1e-30)} == {1}
