"""The safetensors readers (agent/convert/safetensors_io.read_header, and read_tensors' one pass), by
hypothesis, against the reference library (`safetensors.torch.save` writes, `safetensors.deserialize` reads).

Files the reference writes read back exactly, read_tensors' with the crc32 of the whole file. Any damaged
file (the header respaced, a dtype swapped for another of its size, an entry or field replaced by an
arbitrary JSON value, offsets moved or a tensor's span shifted whole, a wrong length prefix, a truncation,
a flipped header byte) is either read consistently or refused with one CheckpointError line, and never
refused when the reference reads it; read_tensors reads the bytes the header reader names.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agent.convert.errors import CheckpointError
from agent.convert.safetensors_io import ITEMSIZES, TORCH_DTYPES, TensorInfo, read_header, read_tensors

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

Tensors = dict[str, dict]  # name -> {"dtype": safetensors code, "shape": [int], "data": bytes}


def serialize(tensors: Tensors) -> bytes:
    """The file the reference library writes for `tensors`, each tensor holding exactly its bytes."""
    def tensor(t: dict) -> torch.Tensor:
        raw = (torch.frombuffer(bytearray(t["data"]), dtype=torch.uint8) if t["data"]
               else torch.empty(0, dtype=torch.uint8))
        return raw.view(TORCH_DTYPES[t["dtype"]]).reshape(t["shape"])
    return safetensors.torch.save({name: tensor(t) for name, t in tensors.items()})


@st.composite
def tensors(draw) -> Tensors:
    names = draw(st.lists(st.text(min_size=1, max_size=10).filter(lambda n: n != "__metadata__"),
                          min_size=1, max_size=6, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(sorted(ITEMSIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = math.prod(shape) * ITEMSIZES[dtype]
        out[name] = {"dtype": dtype, "shape": shape, "data": draw(st.binary(min_size=n, max_size=n))}
    return out


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


@st.composite
def damaged_files(draw) -> bytes:
    raw = serialize(draw(tensors()))
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    how = draw(st.sampled_from(["respaced", "dtype", "entry", "field", "offsets", "shift", "length", "truncate",
                                "byte"]))
    if how == "dtype":  # another code of the same size: still a file the reference reads
        size = ITEMSIZES[header[name]["dtype"]]
        header[name]["dtype"] = draw(st.sampled_from(sorted(c for c, s in ITEMSIZES.items() if s == size)))
    elif how == "entry":
        header[name] = draw(JSON_VALUES)
    elif how == "field":
        header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON_VALUES)
    elif how == "offsets":
        header[name]["data_offsets"] = draw(st.lists(st.integers(-8, len(data) + 8), min_size=2, max_size=2))
    elif how == "shift":  # the same length elsewhere: over a neighbour's bytes, or past the end
        begin, end = header[name]["data_offsets"]
        delta = draw(st.integers(-begin, len(data) - begin))
        header[name]["data_offsets"] = [begin + delta, end + delta]
    if how in ("respaced", "dtype", "entry", "field", "offsets", "shift"):
        text = json.dumps(header, indent=draw(st.none() | st.integers(0, 2))).encode()
        return len(text).to_bytes(8, "little") + text + data
    if how == "length":
        return draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + raw[8:]
    if how == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    at = draw(st.integers(8, 8 + n - 1))
    return raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1:]


def _write(tmp_path: Path, raw: bytes) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw)
    return path


def _bytes(raw: bytes, info: TensorInfo) -> bytes:
    return raw[info.span.offset:info.span.offset + info.span.nbytes]


@SETTINGS
@given(tensors())
def test_a_file_the_reference_writes_reads_back_exactly(tmp_path, written):
    raw = serialize(written)
    infos = read_header(_write(tmp_path, raw))
    assert infos.keys() == written.keys()
    for name, want in written.items():
        info = infos[name]
        assert (info.name, info.dtype, info.shape) == (name, want["dtype"], tuple(want["shape"]))
        assert _bytes(raw, info) == want["data"]


@SETTINGS
@given(damaged_files())
def test_any_file_is_read_consistently_or_refused_in_one_line(tmp_path, raw):
    try:
        reference = {name: t for name, t in safetensors.deserialize(raw)}
    except Exception:  # the reference refuses it (SafetensorError, or a panic surfaced as an exception)
        reference = None
    try:
        infos = read_header(_write(tmp_path, raw))
    except CheckpointError as exc:
        assert "\n" not in str(exc) and "model.safetensors" in str(exc)
        assert reference is None, f"refused a file the reference reads: {exc}"
        event("refused")
        return
    event("read, and the reference " + ("reads it too" if reference is not None else "refuses it"))
    ranges = sorted((i.span.offset, i.span.offset + i.span.nbytes) for i in infos.values() if i.span.nbytes)
    assert all(0 <= begin and end <= len(raw) for begin, end in ranges)
    assert all(a_end <= b_begin for (_, a_end), (b_begin, _) in zip(ranges, ranges[1:])), "overlapping tensors"
    for info in infos.values():
        assert all(type(d) is int and d >= 0 for d in info.shape)
        if info.dtype in ITEMSIZES:
            assert math.prod(info.shape) * ITEMSIZES[info.dtype] == info.span.nbytes
    if reference is not None:
        assert infos.keys() == reference.keys()
        for name, info in infos.items():
            assert (info.dtype, list(info.shape)) == (reference[name]["dtype"], reference[name]["shape"])
            assert _bytes(raw, info) == bytes(reference[name]["data"])


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@SETTINGS
@given(tensors())
def test_read_tensors_reads_what_the_reference_wrote_and_the_files_crc(tmp_path, written):
    raw = serialize(written)
    got, crc = read_tensors(_write(tmp_path, raw))
    assert crc == zlib.crc32(raw)
    assert got.keys() == written.keys()
    for name, want in written.items():
        assert (got[name].dtype, list(got[name].shape)) == (TORCH_DTYPES[want["dtype"]], want["shape"])
        assert _tensor_bytes(got[name]) == want["data"]


@SETTINGS
@given(damaged_files())
def test_read_tensors_reads_what_the_header_reader_reads_or_refuses_in_one_line(tmp_path, raw):
    """Whatever the header reader takes, the one pass reads the same bytes (gaps included in the crc)."""
    path = _write(tmp_path, raw)
    try:
        infos = read_header(path)
    except CheckpointError:
        infos = None
    try:
        got, crc = read_tensors(path)
    except CheckpointError as exc:
        assert "\n" not in str(exc) and "model.safetensors" in str(exc)
        assert infos is None or any(i.dtype not in TORCH_DTYPES for i in infos.values()), exc
        return
    assert infos is not None and crc == zlib.crc32(raw)
    assert all(_tensor_bytes(got[name]) == _bytes(raw, info) for name, info in infos.items())


def test_overlapping_tensors_are_named(tmp_path):
    raw = serialize({"a": {"dtype": "F32", "shape": [4], "data": bytes(16)},
                     "b": {"dtype": "F32", "shape": [4], "data": bytes(16)}})
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["b"]["data_offsets"] = [8, 24]  # b's first half is a's second half
    text = json.dumps(header).encode()
    with pytest.raises(CheckpointError, match="tensors 'a' and 'b' share bytes"):
        read_header(_write(tmp_path, len(text).to_bytes(8, "little") + text + raw[8 + n:]))
