"""The 8-bit delta codec: one series chunk of (time, value) points as bytes.

Layout (all integers little-endian):

    header   byte FORMAT (4), varint n_points, zigzag-varint t0_ms, zigzag-varint v0
    stream   times:  n-1 delta-of-deltas of t_ms      (time resolution 1 ms)
    stream   values: n-1 deltas of v (fixed-point ints: round(value / precision))

Each stream is one signed byte per delta, code in [-126, 127]; two byte values are reserved:
ESC (-128) says "this delta did not fit, take the next entry of the exceptions section" and
RUN (-127) says "a run of zeros, take its length from the runs section". Runs are what bring a
steady series under one byte per point (a 1 Hz sampler has delta-of-delta 0 almost always, a
flat gauge delta 0). Exceptions (zigzag varints) and run lengths (varints) sit in their own
sections after the codes, so decoding is a handful of numpy operations, not a Python loop per
byte:

    stream   = varint (n_codes << 2 | 0), varint n_exceptions, varint n_runs,
               codes (n_codes x int8), exceptions (n_exceptions x zigzag varint),
               run lengths (n_runs x varint)

When larger deltas are the rule rather than the exception (a busy disk's byte rate, free memory
under churn), the escape byte in front of each is pure overhead. Such a stream is stored in one of
two other layouts, whichever of the three is smallest (the low two bits of the first varint say
which; ties go to the lower mode):

    mode 1   = varint (n_deltas << 2 | 1), deltas (n_deltas x zigzag varint)
    mode 2   = varint (n_deltas << 2 | 2), byte k, varint n_prefix_bytes,
               prefixes (n_prefix_bytes), payloads (the rest of the stream's bytes)

Mode 2 is exponential-Golomb coding of order k (k chosen per chunk and stream, 0..63) of each
delta's zigzag z: w = z + 2**k has L + k + 1 bits; the prefix is L zero bits then a one, the payload
the low L + k bits of w. Prefixes and payloads are packed MSB-first into two separate bit sections
(each zero-padded to a whole byte), so decoding is vectorised too: the ones of the prefix section
give every L, their cumulative widths every payload's place. Busy series move by thousands of
steps a second (free memory in 4 KiB pages, read KiB/s, io stall us): 16-20 bits a delta here
where their varints average 19-23 (the recorded fixture, all series: 1.25 -> 1.09 bytes per point
at 600-point chunks).
The encoder keeps, per delta, two counts (its bit length, and from which k on adding 2**k carries
into a new top bit), from which the size at every k follows exactly; the smallest k is written.

Format 3 had modes 0 and 1 only, in the low bit (varint (n << 1 | mode)); format 2 had mode 0
only, with no mode bit. Both are still decoded.

Fixed-point values must lie within +-2**62 (so every difference fits int64); counters with
precision 1 are therefore exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMAT = 4           # first byte of every chunk; 2 (byte streams only) and 3 (+ varint) are still read
READABLE_FORMATS = (2, 3, 4)
BYTES, VARINTS, GOLOMB = 0, 1, 2   # stream modes (format 4: low two bits of the stream's first varint)
MAX_K = 63           # largest order of the mode-2 code
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
    pays for the new points only. The byte and varint layouts are kept as bytes, mode 2 as counts
    (and the bit sections of the orders written lately); `write` emits the smallest."""

    def __init__(self) -> None:
        self.n = 0
        self.codes = bytearray()
        self.exceptions = bytearray()      # zigzag varints
        self.runs = bytearray()            # varints
        self.n_exceptions = self.n_runs = 0
        self.zeros = 0                     # a run of zeros not yet emitted
        self.varints = bytearray()         # the varint layout: every delta as a zigzag varint
        self.zigzags: list[int] = []       # mode 2 is encoded from these, at the k written
        # how many zigzags have each bit length b (0..64), then (as differences over k, 65..130)
        # for how many z + 2**k has b + 1 bits although k < b: mode 2's size at every k follows
        self.counts = np.zeros(131)        # (float: the product below runs in BLAS; exact < 2**53)
        self.golomb: dict[int, tuple[_BitWriter, _BitWriter]] = {}  # per k written lately: its bit sections

    def push(self, d: int) -> None:
        self.n += 1
        z = _zigzag(d)
        _varint(z, self.varints)
        self.zigzags.append(z)
        b = z.bit_length()
        counts = self.counts
        counts[b] += 1
        counts[65 + (z ^ ((1 << b) - 1)).bit_length()] += 1   # bits k..b-1 of z all ones: k >= this
        counts[65 + b] -= 1

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
        _varint(len(codes) << 2 | BYTES, byte_mode)
        _varint(self.n_exceptions, byte_mode)
        _varint(self.n_runs + (self.zeros >= MIN_RUN), byte_mode)
        byte_mode += codes + self.exceptions + runs
        best = byte_mode
        varint_head = bytearray()
        _varint(self.n << 2 | VARINTS, varint_head)
        if len(varint_head) + len(self.varints) < len(best):
            best = varint_head + self.varints
        if (self.n + 7) // 8 + 3 < len(best):            # mode 2 needs a bit per delta and a head
            size = self.golomb_sizes()
            k = int(size.argmin())
            if size[k] + 3 < len(best):                  # its head is >= 3 bytes
                golomb = self.golomb_stream(k)
                if len(golomb) < len(best):
                    best = golomb
        out += best

    def golomb_sizes(self) -> np.ndarray:
        """Bytes of mode 2's two bit sections for every order k = 0..MAX_K (heads not counted)."""
        prefix_zeros = (self.counts @ _SUM_L).astype(np.int64)    # sum of L, per k
        return (prefix_zeros + (self.n + 7)) // 8 + (prefix_zeros + (self.n * _K + 7)) // 8

    def golomb_stream(self, k: int) -> bytearray:
        """The stream in mode 2 at order k (0..MAX_K), whether or not it is the smallest."""
        prefixes, payloads = self.golomb.get(k) or (_BitWriter(), _BitWriter())
        if prefixes.count < self.n:                     # deltas pushed since k was last written:
            prefixes, payloads = prefixes.copy(), payloads.copy()   # (a copy of this encoder may share them)
            for z in self.zigzags[prefixes.count:]:
                _golomb_code(z, k, prefixes, payloads)
            self.golomb = {j: v for j, v in self.golomb.items() if abs(j - k) <= 1}  # the likely next
            self.golomb[k] = prefixes, payloads
        prefix_bytes = prefixes.getvalue()
        stream = bytearray()
        _varint(self.n << 2 | GOLOMB, stream)
        stream.append(k)
        _varint(len(prefix_bytes), stream)
        return stream + prefix_bytes + payloads.getvalue()

    def copy(self) -> "StreamEncoder":
        twin = StreamEncoder.__new__(StreamEncoder)
        twin.__dict__.update({k: (bytearray(v) if isinstance(v, bytearray) else v)
                              for k, v in self.__dict__.items()})
        twin.zigzags, twin.counts = list(self.zigzags), self.counts.copy()
        twin.golomb = dict(self.golomb)    # shared bit sections: golomb_stream copies before extending
        return twin


def _golomb_code(z: int, k: int, prefixes: "_BitWriter", payloads: "_BitWriter") -> None:
    w = z + (1 << k)
    width = w.bit_length() - 1                  # L + k
    prefixes.write(1, width - k + 1)
    prefixes.count += 1
    payloads.write(w ^ (1 << width), width)


_K = np.arange(MAX_K + 1)
# counts @ _SUM_L = sum of L per k: b - 1 - k for a zigzag of bit length b > k (else 0), plus one
# where z + 2**k carries (the cumulative sum over k of the differences in counts[65:])
_SUM_L = np.vstack([np.maximum(np.arange(65)[:, None] - 1 - _K[None, :], 0),
                    np.arange(66)[:, None] <= _K[None, :]]).astype(np.float64)


class _BitWriter:
    """Bits appended MSB-first; `getvalue()` pads the last byte with zeros (without closing it)."""
    __slots__ = ("data", "acc", "bits", "count")

    def __init__(self) -> None:
        self.data = bytearray()
        self.acc = self.bits = 0           # the `bits` (< 8) low bits of acc are not yet in data
        self.count = 0                     # codes written (kept by the caller)

    def write(self, value: int, width: int) -> None:
        acc, bits = (self.acc << width) | value, self.bits + width
        while bits >= 8:
            bits -= 8
            self.data.append((acc >> bits) & 0xFF)
        self.acc, self.bits = acc & ((1 << bits) - 1), bits

    def getvalue(self) -> bytes:
        return bytes(self.data) + (bytes([(self.acc << (8 - self.bits)) & 0xFF]) if self.bits else b"")

    def copy(self) -> "_BitWriter":
        twin = _BitWriter()
        twin.data, twin.acc, twin.bits, twin.count = bytearray(self.data), self.acc, self.bits, self.count
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


def _decode_golomb(buf: bytes, pos: int, n: int) -> tuple[np.ndarray, int]:
    """Mode 2 (see the module layout): n exp-Golomb codes of order k, as zigzags (uint64)."""
    if pos >= len(buf):
        raise CodecError("chunk truncated before a stream's Golomb order")
    k = buf[pos]
    if k > MAX_K:
        raise CodecError(f"chunk corrupt: Golomb order {k} > {MAX_K}")
    n_prefix, pos = _read_varint(buf, pos + 1)
    if pos + n_prefix > len(buf):
        raise CodecError(f"chunk truncated: {n_prefix} prefix bytes announced, {len(buf) - pos} left")
    prefix_bits = np.unpackbits(np.frombuffer(buf, np.uint8, n_prefix, pos))
    pos += n_prefix
    ones = np.flatnonzero(prefix_bits)
    if len(ones) != n or n_prefix != (int(ones[-1]) + 8) // 8 if n else n_prefix:
        raise CodecError(f"chunk corrupt: {len(ones)} Golomb prefixes for {n} deltas")
    widths = np.diff(ones, prepend=-1) - 1 + k          # L + k payload bits each
    if n and widths.max() > 64:
        raise CodecError("chunk corrupt: a Golomb code is longer than 64 bits")
    total = int(widths.sum())
    n_payload = (total + 7) // 8
    if pos + n_payload > len(buf):
        raise CodecError(f"chunk truncated: {n_payload} payload bytes needed, {len(buf) - pos} left")
    padded = np.zeros(n_payload + 16, np.uint8)
    padded[:n_payload] = np.frombuffer(buf, np.uint8, n_payload, pos)
    pos += n_payload
    starts = np.cumsum(widths) - widths                     # each payload's first bit
    first = (starts >> 3)[:, None] + np.arange(8)
    word = padded[first].view(">u8").ravel().astype(np.uint64)      # 64 bits from its first byte
    after = padded[first + 8].view(">u8").ravel().astype(np.uint64)  # and the 64 after them
    offset = (starts & 7).astype(np.uint64)
    window = (word << offset) | ((after >> np.uint64(1)) >> (np.uint64(63) - offset))
    shift = (64 - np.maximum(widths, 1)).astype(np.uint64)
    payload = np.where(widths > 0, window >> shift, np.uint64(0))
    # z = payload + 2**width - 2**k modulo 2**64 (a width of 64 is the top of the uint64 range)
    top = np.where(widths >= 64, np.uint64(0), np.uint64(1) << np.minimum(widths, 63).astype(np.uint64))
    with np.errstate(over="ignore"):
        return payload + top - np.uint64(1 << k), pos


def _decode_stream(buf: bytes, pos: int, fmt: int) -> tuple[np.ndarray, int]:
    head, pos = _read_varint(buf, pos)
    if fmt == 2:
        mode, count = BYTES, head      # format 2 had byte streams only, no mode bit
    elif fmt == 3:
        mode, count = head & 1, head >> 1
    else:
        mode, count = head & 3, head >> 2
    if mode == VARINTS:
        zigzags, pos = _read_varints(buf, pos, count)
        return _unzigzag_array(zigzags), pos
    if mode == GOLOMB:
        zigzags, pos = _decode_golomb(buf, pos, count)
        return _unzigzag_array(zigzags), pos
    if mode != BYTES:
        raise CodecError(f"chunk corrupt: unknown stream mode {mode}")
    n_codes = count
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
