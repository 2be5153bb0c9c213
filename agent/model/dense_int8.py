"""Dense linears in int8 (generate / serve --dense int8): attention projections, shared experts and dense
MLPs, and the LM head.

Quantized when the model loads, as int8 experts are at convert (agent/experts/quant.py: symmetric, one
scale per output channel), so a store serves either way unchanged. A decode step's dense linears are
matvecs bound by memory bandwidth: half the bytes to read, through torch's int8-weight kernel (one token
through OLMoE's 64 attention matrices, one thread, dev checks: 56-60 ms as bf16, 20-34 ms in int8, the
machine quiet to busy), and half the dense RAM.
Computed by linear_int8, as the experts are: the kernel up to 8 tokens, W8A8 above if the model's int8
activations are on. Embeddings, norms and routers stay as stored (their ops are not matmuls, or tiny), and
so does a tied LM head's embedding: the head gets its own int8 copy.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from agent.bf16_matvec import by_rows
from agent.experts.quant import linear_int8, quantize_rows
from agent.model.model import Linear

DENSE_MODES = ("stored", "int8")  # the dense weights as the store holds them, or int8 (this module)
# One token's int8 matvec this large is split by rows over the step's workers (bf16_matvec.by_rows). A dev check on
# two workers, a core busy with other work, split against whole: 64 of OLMoE's 2048 x 2048 attention matrices
# 0.77x, its LM head (50304 x 2048) 1.7x.
SPLIT_MIN_BYTES = 16 * 2**20
QUANTIZE_ROWS = 4096
_SCALE_DTYPE = {torch.float16: torch.float32}  # float16 cannot hold a row of small weights' scale (layout.py)


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + bias; one token's rows are split over the step's workers where large."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None, activations: bool) -> None:
        super().__init__()
        self.q, self.scale, self.bias, self.activations = q, scale, bias, activations   # [out, in], [out], [out]

    @classmethod
    def of(cls, linear: nn.Linear, activations: bool = True) -> Int8Linear:
        w = linear.weight.detach()
        q, scale = quantize_by_rows(w, _SCALE_DTYPE.get(w.dtype, w.dtype))
        return cls(q, scale, None if linear.bias is None else linear.bias.detach(), activations)

    def forward(self, x: Tensor) -> Tensor:
        """x [t, in] -> [t, out]"""
        if x.shape[0] == 1:
            outs = by_rows(self.q.shape[0], self.q.nbytes, self._rows(x), SPLIT_MIN_BYTES)
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        else:
            out = linear_int8(x, self.q, self.scale, self.activations)
        return out if self.bias is None else out + self.bias

    def _rows(self, x: Tensor) -> Callable[[slice], Tensor]:
        return lambda rows: linear_int8(x, self.q[rows], self.scale[rows], self.activations)


def quantize_by_rows(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """quantize_rows(w, dtype), QUANTIZE_ROWS rows at a time (each row is quantized alone): its float32 passes
    over a whole LM head would hold ~1.2 GB at once (OLMoE's), more than the head's int8 copy saves."""
    q, scale = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0], dtype=dtype)
    for start in range(0, w.shape[0], QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        q[rows], scale[rows] = quantize_rows(w[rows], dtype)
    return q, scale


def quantize_dense(model: nn.Module, activations: bool = True) -> None:
    """Replace every dense linear of `model` (agent/model/model.py's Linear) by its Int8Linear, one at a
    time, so each stored matrix is freed as soon as its int8 copy is made (unless a tied embedding holds it)."""
    for path in [name for name, m in model.named_modules() if isinstance(m, Linear)]:   # names: no module held
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, Int8Linear.of(getattr(owner, name), activations))
