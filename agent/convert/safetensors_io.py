"""Safetensors files streamed both ways, never mapped or loaded whole.

read_header gives each tensor's dtype, shape and byte range (Span) from the file's header alone;
write_safetensors writes a file one tensor at a time, copying file-backed tensors in chunks. No
mmap (whose touched pages would count as resident), so memory stays at one copy chunk whatever the
checkpoint size.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.convert.errors import CheckpointError

# safetensors dtype code -> (torch dtype name, itemsize); the float types experts come in.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}
_NUMPY_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class Span:
    """A byte range of one file."""
    file: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str             # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    span: Span             # the tensor's data in its file


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header only; checks the file is long enough."""
    size = path.stat().st_size
    n, header = _raw_header(path, size)
    tensors = {}
    for name, meta in header.items():
        try:
            begin, end = meta["data_offsets"]
            info = TensorInfo(name, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]),
                              Span(path, 8 + n + int(begin), int(end) - int(begin)))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the header entry of {name} is malformed; re-download the file") from None
        if info.span.offset + info.span.nbytes > size:
            raise CheckpointError(f"{path} is truncated: tensor {name} needs bytes up to "
                                  f"{info.span.offset + info.span.nbytes} but the file has {size}; re-download it")
        if info.dtype in DTYPES and math.prod(info.shape) * DTYPES[info.dtype][1] != info.span.nbytes:
            raise CheckpointError(f"{path}: tensor {name} has {info.span.nbytes} bytes, not what "
                                  f"shape {list(info.shape)} {info.dtype} needs; the file is corrupt")
        tensors[name] = info
    return tensors


def _raw_header(path: Path, size: int) -> tuple[int, dict]:
    """(header length, header without __metadata__) of a safetensors file: 8-byte length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise CheckpointError(f"{path} is not a safetensors file (bad header length); re-download it")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({exc}); re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a safetensors header that is not a JSON object; re-download it")
    header.pop("__metadata__", None)
    return n, header


DenseSource = TensorInfo | np.ndarray


def write_safetensors(path: Path, tensors: Sequence[tuple[str, DenseSource]]) -> None:
    """Write a safetensors file one tensor at a time: file-backed tensors are copied in chunks."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, src in tensors:
        dtype, shape, nbytes = _describe(src)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for _, src in tensors:
            if isinstance(src, np.ndarray):
                out.write(np.ascontiguousarray(src).data)
            else:
                _copy_span(src.span, out)


def _describe(src: DenseSource) -> tuple[str, tuple[int, ...], int]:
    if isinstance(src, np.ndarray):
        return _NUMPY_CODES[src.dtype], src.shape, src.nbytes
    return src.dtype, src.shape, src.span.nbytes


def _copy_span(span: Span, out) -> None:
    with open(span.file, "rb", buffering=0) as f:
        done = 0
        while done < span.nbytes:
            chunk = os.pread(f.fileno(), min(_COPY_CHUNK, span.nbytes - done), span.offset + done)
            if not chunk:
                raise CheckpointError(f"{span.file} ended early while copying; was it modified during convert?")
            out.write(chunk)
            done += len(chunk)
