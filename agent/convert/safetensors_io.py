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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.convert.errors import CheckpointError

# safetensors dtype code -> (torch dtype name, itemsize); the float types experts come in.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}
# Bytes per element of every whole-byte safetensors dtype, to check a tensor's size against its shape.
ITEMSIZES = {**{code: size for code, (_, size) in DTYPES.items()}, "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1,
             "F8_E4M3": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8}
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
    """The tensors of one safetensors file, from its header only. Checks that every tensor's bytes lie
    inside the file, match its shape and dtype, and overlap no other tensor's."""
    size = path.stat().st_size
    n, header = _raw_header(path, size)
    tensors = {name: _tensor_info(path, 8 + n, name, meta) for name, meta in header.items()}
    for info in tensors.values():
        end = info.span.offset + info.span.nbytes
        if end > size:
            raise CheckpointError(f"{path} is truncated: tensor {info.name!r} needs bytes up to {end} but the file "
                                  f"has {size}; re-download it")
        itemsize = ITEMSIZES.get(info.dtype)
        if itemsize is not None and math.prod(info.shape) * itemsize != info.span.nbytes:
            raise CheckpointError(f"{path}: tensor {info.name!r} has {info.span.nbytes} bytes, not what "
                                  f"shape {list(info.shape)} {info.dtype} needs; the file is corrupt")
    _check_no_overlap(path, tensors.values())
    return tensors


def _tensor_info(path: Path, data_start: int, name: str, meta: object) -> TensorInfo:
    """One header entry: {"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}, begin <= end."""
    try:
        dtype, shape, (begin, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        dtype = shape = begin = end = None
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_count(d) for d in shape)
            and _is_count(begin) and _is_count(end) and begin <= end):
        raise CheckpointError(f"{path}: the header entry of {name!r} is malformed; re-download the file")
    return TensorInfo(name, dtype, tuple(shape), Span(path, data_start + begin, end - begin))


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_no_overlap(path: Path, tensors) -> None:
    """Two tensors sharing bytes would alias each other's weights once converted."""
    last: TensorInfo | None = None
    for info in sorted((t for t in tensors if t.span.nbytes), key=lambda t: t.span.offset):
        if last is not None and info.span.offset < last.span.offset + last.span.nbytes:
            raise CheckpointError(f"{path}: tensors {last.name!r} and {info.name!r} share bytes (their data_offsets "
                                  f"overlap); the file is corrupt, re-download it")
        last = info


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


@dataclass(frozen=True)
class Lazy:
    """A tensor made only when its turn to be written comes: `make()` returns its bytes as an array
    (e.g. bfloat16 bits as uint16, which numpy lacks), so a file of many tensors is never in RAM whole."""
    dtype: str             # safetensors code
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]


DenseSource = TensorInfo | np.ndarray | Lazy


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
            if isinstance(src, TensorInfo):
                _copy_span(src.span, out)
            else:
                out.write(_data(src))


def payload_bytes(tensors: Sequence[tuple[str, DenseSource]]) -> int:
    """The bytes write_safetensors writes for `tensors`, but for its header."""
    return sum(_describe(src)[2] for _, src in tensors)


def _describe(src: DenseSource) -> tuple[str, tuple[int, ...], int]:
    if isinstance(src, np.ndarray):
        return _NUMPY_CODES[src.dtype], src.shape, src.nbytes
    if isinstance(src, Lazy):
        return src.dtype, src.shape, math.prod(src.shape) * DTYPES[src.dtype][1]
    return src.dtype, src.shape, src.span.nbytes


def _data(src: np.ndarray | Lazy) -> memoryview:
    data = np.ascontiguousarray(src if isinstance(src, np.ndarray) else src.make())
    if isinstance(src, Lazy) and data.nbytes != _describe(src)[2]:
        raise ValueError(f"a lazy {src.dtype} tensor of shape {list(src.shape)} made {data.nbytes} bytes")
    return data.data


def _copy_span(span: Span, out) -> None:
    with open(span.file, "rb", buffering=0) as f:
        done = 0
        while done < span.nbytes:
            chunk = os.pread(f.fileno(), min(_COPY_CHUNK, span.nbytes - done), span.offset + done)
            if not chunk:
                raise CheckpointError(f"{span.file} ended early while copying; was it modified during convert?")
            out.write(chunk)
            done += len(chunk)
