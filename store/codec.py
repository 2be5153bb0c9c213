"""The 8-bit delta codec: one series chunk of (time, value) points as bytes.

Layout (all integers little-endian):

    header   varint n_points, zigzag-varint t0_ms, zigzag-varint v0
    stream   times:  n-1 delta-of-deltas of t_ms      (time resolution 1 ms)
    stream   values: n-1 deltas of v (fixed-point ints: round(value / precision))

Each stream is one signed byte per delta, code in [-126, 127]; two byte values are reserved:
ESC (-128) says "this delta did not fit, take the next entry of the exceptions section" and
RUN (-127) says "a run of zeros, take its length from the runs section". Runs are what bring a
steady series under one byte per point (a 1 Hz sampler has delta-of-delta 0 almost always, a
flat gauge delta 0). Exceptions and run lengths sit in their own fixed-width sections after the
codes, so decoding is a handful of numpy operations, not a Python loop per byte:

    stream   = varint n_codes, byte (exception width | run width << 4),
               varint n_exceptions, varint n_runs,
               codes (n_codes x int8), exceptions (n x int16/32/64), run lengths (n x uint8/16)

Fixed-point values must lie within +-2**62 (so every difference fits int64); counters with
precision 1 are therefore exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ESC = -128
RUN = -127
MIN_RUN = 3          # a run of 2 zeros costs the same as two literal zeros
MAX_RUN = 0xFFFF
_LIMIT = 1 << 62      # |fixed-point| bound so that every difference fits int64


class CodecError(ValueError):
    """A chunk could not be encoded or decoded; the message says which and why."""


@dataclass(frozen=True)
class Decoded:
    """A decoded chunk: times in ms and fixed-point values, both int64 arrays."""
    t_ms: np.ndarray
    q: np.ndarray


def _varint(n: int, out: bytearray) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int) -> int:
    return (n << 1) if n >= 0 else ((-n << 1) - 1)


def _unzigzag(z: int) -> int:
    return (z >> 1) if not z & 1 else -((z + 1) >> 1)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise CodecError("chunk truncated inside a varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _width(values: list[int], choices: tuple[tuple[int, str], ...]) -> tuple[int, str]:
    lo, hi = (min(values), max(values)) if values else (0, 0)
    for size, dtype in choices:
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return size, dtype
    raise CodecError(f"delta {lo if lo < 0 else hi} does not fit 64 bits")


_EXC_WIDTHS = ((2, "<i2"), (4, "<i4"), (8, "<i8"))
_RUN_WIDTHS = ((1, "<u1"), (2, "<u2"))
_DTYPE_BY_SIZE = {2: "<i2", 4: "<i4", 8: "<i8", 1: "<u1"}


def _encode_stream(deltas: list[int], out: bytearray) -> None:
    codes = bytearray()
    exceptions: list[int] = []
    runs: list[int] = []
    i, n = 0, len(deltas)
    while i < n:
        d = deltas[i]
        if d == 0:
            j = i
            while j < n and deltas[j] == 0 and j - i < MAX_RUN:
                j += 1
            if j - i >= MIN_RUN:
                codes.append(RUN & 0xFF)
                runs.append(j - i)
            else:
                codes.extend(b"\x00" * (j - i))
            i = j
            continue
        if RUN < d <= 127:
            codes.append(d & 0xFF)
        else:
            codes.append(ESC & 0xFF)
            exceptions.append(d)
        i += 1
    exc_size, exc_dtype = _width(exceptions, _EXC_WIDTHS)
    run_size, run_dtype = _width(runs, _RUN_WIDTHS)
    _varint(len(codes), out)
    out.append(exc_size | run_size << 4)
    _varint(len(exceptions), out)
    _varint(len(runs), out)
    out += codes
    out += np.asarray(exceptions, dtype=exc_dtype).tobytes()
    out += np.asarray(runs, dtype=run_dtype).tobytes()


def _decode_stream(buf: bytes, pos: int) -> tuple[np.ndarray, int]:
    n_codes, pos = _read_varint(buf, pos)
    if pos >= len(buf):
        raise CodecError("chunk truncated before a stream's widths")
    widths = buf[pos]
    pos += 1
    exc_size, run_size = widths & 0x0F, widths >> 4
    if exc_size not in (2, 4, 8) or run_size not in (1, 2):
        raise CodecError(f"bad stream widths byte {widths:#x}")
    n_exc, pos = _read_varint(buf, pos)
    n_runs, pos = _read_varint(buf, pos)
    end = pos + n_codes + n_exc * exc_size + n_runs * run_size
    if end > len(buf):
        raise CodecError(f"chunk truncated: stream needs {end} bytes, chunk has {len(buf)}")
    codes = np.frombuffer(buf, np.int8, n_codes, pos)
    pos += n_codes
    exceptions = np.frombuffer(buf, _DTYPE_BY_SIZE[exc_size], n_exc, pos)
    pos += n_exc * exc_size
    runs = np.frombuffer(buf, "<u1" if run_size == 1 else "<u2", n_runs, pos)
    pos += n_runs * run_size
    values = codes.astype(np.int64)
    esc_at = np.flatnonzero(codes == ESC)
    run_at = np.flatnonzero(codes == RUN)
    if len(esc_at) != n_exc or len(run_at) != n_runs:
        raise CodecError("chunk corrupt: escape or run count does not match its section")
    values[esc_at] = exceptions
    values[run_at] = 0
    repeats = np.ones(n_codes, np.int64)
    repeats[run_at] = runs
    return np.repeat(values, repeats), pos


def encode(t_ms: list[int], q: list[int]) -> bytes:
    """Encode points given as integer milliseconds and fixed-point integers (same length >= 1)."""
    n = len(t_ms)
    if n == 0 or n != len(q):
        raise CodecError(f"need >= 1 point and equal lengths, got {n} times and {len(q)} values")
    for v in (min(t_ms), max(t_ms), min(q), max(q)):
        if not -_LIMIT < v < _LIMIT:
            raise CodecError(f"fixed-point value {v} is beyond +-2**62; declare a coarser precision")
    dod = [0] * (n - 1)
    prev_delta = 0
    for i in range(1, n):
        delta = t_ms[i] - t_ms[i - 1]
        dod[i - 1] = delta - prev_delta
        prev_delta = delta
    deltas = [q[i] - q[i - 1] for i in range(1, n)]
    out = bytearray()
    _varint(n, out)
    _varint(_zigzag(t_ms[0]), out)
    _varint(_zigzag(q[0]), out)
    _encode_stream(dod, out)
    _encode_stream(deltas, out)
    return bytes(out)


def decode(data: bytes) -> Decoded:
    """Decode a chunk written by `encode`; raises CodecError if it is truncated or corrupt."""
    n, pos = _read_varint(data, 0)
    z_t0, pos = _read_varint(data, pos)
    z_v0, pos = _read_varint(data, pos)
    dod, pos = _decode_stream(data, pos)
    deltas, pos = _decode_stream(data, pos)
    if len(dod) != n - 1 or len(deltas) != n - 1 or pos != len(data):
        raise CodecError(f"chunk corrupt: header says {n} points, streams hold "
                         f"{len(dod) + 1} and {len(deltas) + 1}, {len(data) - pos} bytes left over")
    t = np.empty(n, np.int64)
    t[0] = _unzigzag(z_t0)
    t[1:] = np.cumsum(np.cumsum(dod))
    t[1:] += t[0]
    q = np.empty(n, np.int64)
    q[0] = _unzigzag(z_v0)
    q[1:] = np.cumsum(deltas) + q[0]
    return Decoded(t, q)
