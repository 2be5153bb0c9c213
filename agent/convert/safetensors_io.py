"""Safetensors files streamed both ways, never mapped.

read_header gives each tensor's dtype, shape and byte range (Span) from the file's header alone;
read_tensors reads every tensor into the process in one pass and takes the file's crc32 over the same
bytes; write_safetensors writes a file one tensor at a time, copying file-backed tensors in chunks. No
mmap (whose touched pages would count as resident, and could be dropped and faulted back in).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agent.convert.errors import CheckpointError
from agent.experts.layout import crc32

# safetensors dtype code -> (torch dtype name, itemsize); the float types experts come in.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}
# Every whole-byte safetensors dtype as torch's; its itemsize checks a tensor's size against its shape.
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
                "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "I32": torch.int32,
                "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64}
ITEMSIZES = {code: dtype.itemsize for code, dtype in TORCH_DTYPES.items()}
_NUMPY_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
_COPY_CHUNK = 8 << 20
_READ_CHUNK = 16 << 20   # a read of read_tensors: the device's pace, and its pages leave the page cache soon
_DROP_AGAIN = 4 * _READ_CHUNK


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


def read_header(path: Path, remedy: str = "re-download it") -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header only. Checks that every tensor's bytes lie
    inside the file, match its shape and dtype, and overlap no other tensor's; an error ends with `remedy`."""
    size = path.stat().st_size
    n, header = _raw_header(path, size, remedy)
    tensors = {name: _tensor_info(path, 8 + n, name, meta, remedy) for name, meta in header.items()}
    for info in tensors.values():
        end = info.span.offset + info.span.nbytes
        if end > size:
            raise CheckpointError(f"{path} is truncated: tensor {info.name!r} needs bytes up to {end} but the file "
                                  f"has {size}; {remedy}")
        itemsize = ITEMSIZES.get(info.dtype)
        if itemsize is not None and math.prod(info.shape) * itemsize != info.span.nbytes:
            raise CheckpointError(f"{path}: tensor {info.name!r} has {info.span.nbytes} bytes, not what "
                                  f"shape {list(info.shape)} {info.dtype} needs; the file is corrupt, {remedy}")
    _check_no_overlap(path, tensors.values(), remedy)
    return tensors


def _tensor_info(path: Path, data_start: int, name: str, meta: object, remedy: str) -> TensorInfo:
    """One header entry: {"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}, begin <= end."""
    try:
        dtype, shape, (begin, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        dtype = shape = begin = end = None
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_count(d) for d in shape)
            and _is_count(begin) and _is_count(end) and begin <= end):
        raise CheckpointError(f"{path}: the header entry of {name!r} is malformed; {remedy}")
    return TensorInfo(name, dtype, tuple(shape), Span(path, data_start + begin, end - begin))


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_no_overlap(path: Path, tensors, remedy: str) -> None:
    """Two tensors sharing bytes would alias each other's weights once converted."""
    last: TensorInfo | None = None
    for info in sorted((t for t in tensors if t.span.nbytes), key=lambda t: t.span.offset):
        if last is not None and info.span.offset < last.span.offset + last.span.nbytes:
            raise CheckpointError(f"{path}: tensors {last.name!r} and {info.name!r} share bytes (their data_offsets "
                                  f"overlap); the file is corrupt, {remedy}")
        last = info


def _raw_header(path: Path, size: int, remedy: str) -> tuple[int, dict]:
    """(header length, header without __metadata__) of a safetensors file: 8-byte length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise CheckpointError(f"{path} is not a safetensors file (bad header length); {remedy}")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({exc}); {remedy}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a safetensors header that is not a JSON object; {remedy}")
    header.pop("__metadata__", None)
    return n, header


def read_tensors(path: Path, remedy: str = "re-download it") -> tuple[dict[str, torch.Tensor], int]:
    """(every tensor of a safetensors file, the crc32 of the whole file). One pass in file order: each tensor's
    bytes are read straight into it and crc'd as they arrive, and each read's pages leave the page cache
    behind it, so a file of gigabytes is neither read twice nor held in the page cache beside the copy."""
    infos = read_header(path, remedy)
    unknown = sorted({i.dtype for i in infos.values()} - TORCH_DTYPES.keys())
    if unknown:
        raise CheckpointError(f"{path} holds tensors of dtype {', '.join(unknown)}, which torch cannot hold; {remedy}")
    tensors = {i.name: torch.empty(i.shape, dtype=TORCH_DTYPES[i.dtype]) for i in infos.values()}
    with open(path, "rb", buffering=0) as f:
        crc, at = 0, 0
        for info in sorted((i for i in infos.values() if i.span.nbytes), key=lambda i: i.span.offset):
            crc = _crc_between(f, at, info.span.offset, crc)              # the header, and any gap
            crc = _read_into(f, info.span.offset, tensors[info.name].reshape(-1).view(torch.uint8).numpy(), crc)
            at = info.span.offset + info.span.nbytes
        crc = _crc_between(f, at, os.fstat(f.fileno()).st_size, crc)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)       # the header's pages, any read ahead
    return tensors, crc


def _crc_between(f, begin: int, end: int, crc: int) -> int:
    """crc32 carried over the file's bytes [begin, end), which no tensor holds."""
    scratch = np.empty(min(_READ_CHUNK, end - begin), np.uint8)
    for start in range(begin, end, _READ_CHUNK):
        crc = _read_into(f, start, scratch[:min(_READ_CHUNK, end - start)], crc)
    return crc


def _read_into(f, offset: int, buf: np.ndarray, crc: int) -> int:
    """Fill `buf` from the file at `offset` chunk by chunk, each chunk crc'd and its pages dropped once read;
    the crc carried on."""
    view = memoryview(buf).cast("B")
    for start in range(0, len(view), _READ_CHUNK):
        chunk = view[start:start + _READ_CHUNK]
        got = 0
        while got < len(chunk):
            n = os.preadv(f.fileno(), [chunk[got:]], offset + start + got)
            if not n:
                raise CheckpointError(f"{f.name} ended early while being read; was it modified meanwhile?")
            got += n
        crc = crc32(chunk, crc)
        # The chunk's pages and a few chunks before it again: a range dropped once kept ~680 MB of a 3.7 GB file
        # cached (pages still busy then stay); dropped again as the read moves on, 34 MB (bench/dense_check.py).
        behind = max(0, offset + start - _DROP_AGAIN)
        os.posix_fadvise(f.fileno(), behind, offset + start + len(chunk) - behind, os.POSIX_FADV_DONTNEED)
    return crc


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
