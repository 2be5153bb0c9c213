"""The compiled bf16 matvec against the exact product, and the inputs it leaves to torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agent import bf16_matvec
from agent.bf16_matvec import linear


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |t| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(2.0 ** -126))) - 7)


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (64, 48), (1024, 2048), (2048, 1024), (7, 4099)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_bf16_row_is_the_exact_product_rounded_once(rows, cols, with_bias):
    g = torch.Generator().manual_seed(rows * cols)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    x = torch.randn(1, cols, generator=g).bfloat16()
    bias = torch.randn(rows, generator=g).bfloat16() if with_bias else None
    before = None if bias is None else bias.clone()
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    got = linear(x, w, bias)   # no tensor requires grad: no inference mode needed
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows)
    assert ((got.double() - exact).abs() <= bf16_ulp(exact)).all()   # float32 sums, one rounding to bf16
    assert bias is None or torch.equal(bias, before)


def test_other_inputs_are_torchs_own_linear():
    w = torch.randn(32, 64).bfloat16()
    cases = [(torch.randn(2, 64).bfloat16(), w),                       # two rows: torch's GEMM reuses w
             (torch.randn(1, 64), w.float()),                          # float32
             (torch.randn(1, 32).bfloat16(), w.T),                     # a weight that is not contiguous
             (torch.randn(64).bfloat16(), w)]                          # a vector, not a row
    with torch.inference_mode():
        for x, weight in cases:
            assert torch.equal(linear(x, weight), F.linear(x, weight))
    x = torch.randn(1, 64).bfloat16()
    param = torch.nn.Parameter(w)
    assert linear(x, param).requires_grad                              # autograd records: torch computes it
    with torch.inference_mode():
        assert not linear(x, param).requires_grad                      # a model's weights at inference: the loop


def test_the_loop_serves_inference_and_plain_tensors(monkeypatch):
    calls = []
    real = bf16_matvec._matvec
    monkeypatch.setattr(bf16_matvec, "_matvec", lambda *a: calls.append(1) or real(*a))
    param = torch.nn.Parameter(torch.randn(32, 64).bfloat16())
    x = torch.randn(1, 64).bfloat16()
    linear(x, param.detach())
    with torch.inference_mode():
        linear(x, param)
    linear(x, param)                                                   # autograd records this one: torch
    assert len(calls) == 2


def test_nan_and_infinity_propagate_as_in_torch():
    w = torch.randn(8, 40).bfloat16()
    x = torch.randn(1, 40).bfloat16()
    x[0, 3] = float("nan")
    assert linear(x, w).isnan().all()
    w[2, 7] = float("inf")
    x[0, 3], x[0, 7] = 1.0, 1.0
    got = linear(x, w)
    assert got[0, 2] == float("inf") and got[0, [0, 1, 3, 4, 5, 6, 7]].isfinite().all()
