"""The 8-bit delta codec: one series chunk of (time, value) points as bytes.

Layout (all integers little-endian):

    header   byte FORMAT (3), varint n_points, zigzag-varint t0_ms, zigzag-varint v0
    stream   times:  n-1 delta-of-deltas of t_ms      (time resolution 1 ms)
    stream   values: n-1 deltas of v (fixed-point ints: round(value / precision))

Each stream is one signed byte per delta, code in [-126, 127]; two byte values are reserved:
ESC (-128) says "this delta did not fit, take the next entry of the exceptions section" and
RUN (-127) says "a run of zeros, take its length from the runs section". Runs are what bring a
steady series under one byte per point (a 1 Hz sampler has delta-of-delta 0 almost always, a
flat gauge delta 0). Exceptions (zigzag varints) and run lengths (varints) sit in their own
sections after the codes, so decoding is a handful of numpy operations, not a Python loop per
byte:

    stream   = varint (n_codes << 1), varint n_exceptions, varint n_runs,
               codes (n_codes x int8), exceptions (n_exceptions x zigzag varint),
               run lengths (n_runs x varint)

When larger deltas are the rule rather than the exception (a busy disk's byte rate, free memory
under churn), the escape byte in front of each is pure overhead; such a stream is stored as plain
zigzag varints instead, whichever is smaller (low bit of the first varint = 1):

    stream   = varint (n_deltas << 1 | 1), deltas (n_deltas x zigzag varint)

Fixed-point values must lie within +-2**62 (so every difference fits int64); counters with
precision 1 are therefore exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMAT = 3           # first byte of every chunk; 2 (no varint streams) is still read
READABLE_FORMATS = (2, 3)
ESC = -128
RUN = -127
MIN_RUN = 3          # a run of 2 zeros costs the same as two literal zeros
_LIMIT = 1 << 62       # |fixed-point| bound: every delta's zigzag fits uint64
_TIME_LIMIT = 1 << 60  # |ms| bound: every delta-of-delta's zigzag fits uint64


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


class StreamEncoder:
    """One stream, encoded delta by delta, so that a writer extending an open chunk every second
    pays for the new points only. Both layouts are kept; `write` emits the smaller."""

    def __init__(self) -> None:
        self.n = 0
        self.codes = bytearray()
        self.exceptions = bytearray()      # zigzag varints
        self.runs = bytearray()            # varints
        self.n_exceptions = self.n_runs = 0
        self.zeros = 0                     # a run of zeros not yet emitted
        self.varints = bytearray()         # the varint layout: every delta as a zigzag varint

    def push(self, d: int) -> None:
        self.n += 1
        _varint(_zigzag(d), self.varints)
        if d == 0:
            self.zeros += 1
            return
        if self.zeros:
            self._emit_zeros(self.codes, self.runs)
            self.n_runs += self.zeros >= MIN_RUN
            self.zeros = 0
        if RUN < d <= 127:
            self.codes.append(d & 0xFF)
        else:
            self.codes.append(ESC & 0xFF)
            _varint(_zigzag(d), self.exceptions)
            self.n_exceptions += 1

    def _emit_zeros(self, codes: bytearray, runs: bytearray) -> None:
        if self.zeros >= MIN_RUN:
            codes.append(RUN & 0xFF)
            _varint(self.zeros, runs)
        else:
            codes.extend(bytes(self.zeros))

    def write(self, out: bytearray) -> None:
        codes, runs = self.codes, self.runs
        if self.zeros:                     # close the pending run on copies; pushing may go on
            codes, runs = bytearray(codes), bytearray(runs)
            self._emit_zeros(codes, runs)
        byte_mode = bytearray()
        _varint(len(codes) << 1, byte_mode)
        _varint(self.n_exceptions, byte_mode)
        _varint(self.n_runs + (self.zeros >= MIN_RUN), byte_mode)
        if len(byte_mode) + len(codes) + len(self.exceptions) + len(runs) <= len(self.varints) + 1:
            out += byte_mode + codes + self.exceptions + runs
        else:
            _varint(self.n << 1 | 1, out)
            out += self.varints

    def copy(self) -> "StreamEncoder":
        twin = StreamEncoder()
        twin.__dict__.update({k: (bytearray(v) if isinstance(v, bytearray) else v)
                              for k, v in self.__dict__.items()})
        return twin


class ChunkEncoder:
    """Points appended one by one; `to_bytes()` is the chunk so far (see the module layout)."""

    def __init__(self) -> None:
        self.n = 0
        self.t0 = self.q0 = self.t_prev = self.q_prev = self.delta_prev = 0
        self.t_min = self.t_max = 0
        self.times, self.values = StreamEncoder(), StreamEncoder()

    def push(self, t_ms: int, q: int) -> None:
        check_point(t_ms, q)
        if self.n == 0:
            self.t0 = self.t_min = self.t_max = self.t_prev = t_ms
            self.q0 = self.q_prev = q
        else:
            delta = t_ms - self.t_prev
            self.times.push(delta - self.delta_prev)
            self.values.push(q - self.q_prev)
            self.delta_prev, self.t_prev, self.q_prev = delta, t_ms, q
            self.t_min, self.t_max = min(self.t_min, t_ms), max(self.t_max, t_ms)
        self.n += 1

    def to_bytes(self) -> bytes:
        if self.n == 0:
            raise CodecError("an empty chunk cannot be encoded")
        out = bytearray([FORMAT])
        _varint(self.n, out)
        _varint(_zigzag(self.t0), out)
        _varint(_zigzag(self.q0), out)
        self.times.write(out)
        self.values.write(out)
        return bytes(out)

    def copy(self) -> "ChunkEncoder":
        twin = ChunkEncoder()
        twin.__dict__.update(self.__dict__)
        twin.times, twin.values = self.times.copy(), self.values.copy()
        return twin

    @classmethod
    def of(cls, t_ms: list[int], q: list[int]) -> "ChunkEncoder":
        if len(t_ms) != len(q):
            raise CodecError(f"need equal lengths, got {len(t_ms)} times and {len(q)} values")
        encoder = cls()
        for t, v in zip(t_ms, q):
            encoder.push(t, v)
        return encoder


def check_point(t_ms: int, q: int) -> None:
    """Refuse a point the codec cannot hold, naming the bound."""
    if not -_TIME_LIMIT < t_ms < _TIME_LIMIT:
        raise CodecError(f"time {t_ms} ms is not within +-2**60 Unix milliseconds")
    if not -_LIMIT < q < _LIMIT:
        raise CodecError(f"fixed-point value {q} is beyond +-2**62; declare a coarser precision")


def _read_varints(buf: bytes, pos: int, count: int) -> tuple[np.ndarray, int]:
    """`count` consecutive varints from pos, vectorised: (uint64 values, position after them)."""
    if count == 0:
        return np.empty(0, np.uint64), pos
    raw = np.frombuffer(buf, np.uint8, len(buf) - pos, pos)
    if len(raw) >= count and raw[:count].max() < 0x80:      # all one-byte: the common case
        return raw[:count].astype(np.uint64), pos + count
    ends = np.flatnonzero(raw < 0x80)[:count]
    if len(ends) < count:
        raise CodecError("chunk truncated inside its exceptions or run lengths")
    raw = raw[:ends[-1] + 1]
    starts = np.r_[0, ends[:-1] + 1]
    group = np.repeat(np.arange(count), ends - starts + 1)
    shift = (np.arange(len(raw)) - starts[group]) * 7
    if shift.max() > 63:
        raise CodecError("chunk corrupt: a varint is longer than 64 bits")
    parts = (raw & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.add.reduceat(parts, starts), pos + len(raw)


def _unzigzag_array(z: np.ndarray) -> np.ndarray:
    return (z >> np.uint64(1)).astype(np.int64) ^ -(z & np.uint64(1)).astype(np.int64)


def _decode_stream(buf: bytes, pos: int, fmt: int) -> tuple[np.ndarray, int]:
    head, pos = _read_varint(buf, pos)
    if fmt == 2:
        head <<= 1                     # format 2 had byte streams only, no mode bit
    if head & 1:
        zigzags, pos = _read_varints(buf, pos, head >> 1)
        return _unzigzag_array(zigzags), pos
    n_codes = head >> 1
    n_exc, pos = _read_varint(buf, pos)
    n_runs, pos = _read_varint(buf, pos)
    if pos + n_codes > len(buf):
        raise CodecError(f"chunk truncated: {n_codes} codes announced, {len(buf) - pos} bytes left")
    codes = np.frombuffer(buf, np.int8, n_codes, pos)
    zigzags, pos = _read_varints(buf, pos + n_codes, n_exc)
    runs, pos = _read_varints(buf, pos, n_runs)
    values = codes.astype(np.int64)
    esc_at = np.flatnonzero(codes == ESC)
    run_at = np.flatnonzero(codes == RUN)
    if len(esc_at) != n_exc or len(run_at) != n_runs:
        raise CodecError("chunk corrupt: escape or run count does not match its section")
    values[esc_at] = _unzigzag_array(zigzags)
    values[run_at] = 0
    repeats = np.ones(n_codes, np.int64)
    repeats[run_at] = runs.astype(np.int64)
    return np.repeat(values, repeats), pos


def encode(t_ms: list[int], q: list[int]) -> bytes:
    """Encode points given as integer milliseconds and fixed-point integers (same length >= 1)."""
    if not t_ms:
        raise CodecError("need >= 1 point to encode a chunk")
    return ChunkEncoder.of(t_ms, q).to_bytes()


def decode(data: bytes) -> Decoded:
    """Decode a chunk written by `encode`; raises CodecError if it is truncated or corrupt."""
    if not data or data[0] not in READABLE_FORMATS:
        raise CodecError(f"not a chunk of format {READABLE_FORMATS} (first byte {data[:1].hex() or 'missing'})")
    fmt = data[0]
    n, pos = _read_varint(data, 1)
    z_t0, pos = _read_varint(data, pos)
    z_v0, pos = _read_varint(data, pos)
    dod, pos = _decode_stream(data, pos, fmt)
    deltas, pos = _decode_stream(data, pos, fmt)
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
