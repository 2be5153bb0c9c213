"""Series points into chunks: each series has one open chunk in the database, rewritten in place
on every flush until it holds `chunk_points` points, then sealed; a new open chunk follows.

The open chunk's encoder is kept, so a flush encodes only the new points and no chunk ever needs
re-reading to be extended; readers see every flushed point. A flush encodes (`encode`) before its
transaction and only writes the encoded chunks inside it (`write`): the write lock is held for the
SQL alone, not for the codec's work on every open chunk (copies, numpy for mode 2's sizes), whose
pages a thrashing agent faults back in while the collector waits on the lock. Not thread-safe on its
own: the Store holds its lock around every call but `encode` and `write`, which its write lock
serialises.
"""
from __future__ import annotations

import math
import numbers
import sqlite3
import time
from dataclasses import dataclass, field

from store import codec
from store.schema import SeriesSpec, spec_for

STALE_OPEN_S = 600.0        # an open chunk not extended for this long is sealed, never rewritten


@dataclass
class _SeriesBuffer:
    spec: SeriesSpec
    open_id: int | None = None              # row id of this writer's open chunk
    encoder: codec.ChunkEncoder | None = None  # that chunk's points so far, ready to extend
    new_points: list[tuple[int, int]] = field(default_factory=list)    # not yet written
    last_write: float = 0.0                 # monotonic time the open chunk was last written

    def seal(self) -> None:
        self.open_id, self.encoder = None, None


Pending = dict[str, tuple[SeriesSpec, int | None, codec.ChunkEncoder | None, list[tuple[int, int]]]]
Opened = dict[str, tuple[int | None, codec.ChunkEncoder | None]]


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk as a row of `chunks`, encoded: it rewrites the open chunk `chunk_id`, or is a new one."""
    chunk_id: int | None
    t_start: float
    t_end: float
    n_points: int
    precision: float
    data: bytes

    @classmethod
    def of(cls, encoder: codec.ChunkEncoder, precision: float, chunk_id: int | None = None) -> "EncodedChunk":
        return cls(chunk_id, encoder.t_min / 1000, encoder.t_max / 1000, encoder.n, precision, encoder.to_bytes())


# per series: its spec, its chunks to write (the last one open unless full), and that open chunk's encoder
Encoded = dict[str, tuple[SeriesSpec, list[EncodedChunk], codec.ChunkEncoder | None]]


def to_fixed(value: float, spec: SeriesSpec) -> int:
    """The codec's fixed-point integer for a value; rejects NaN and infinities by name."""
    if not math.isfinite(value):
        raise ValueError(f"series {spec.name!r}: value {value!r} is not finite; skip the sample instead")
    if spec.precision == 1.0 and isinstance(value, numbers.Integral):
        return int(value)     # counters: exact, even beyond 2**53 (numpy integers too)
    return round(value / spec.precision)


def write_chunk(conn: sqlite3.Connection, series_id: int, chunk: EncodedChunk) -> int:
    """Rewrite chunk `chunk.chunk_id`, or insert a new chunk; returns its id."""
    values = (chunk.t_start, chunk.t_end, chunk.n_points, chunk.precision, chunk.data)
    if chunk.chunk_id is not None:
        cur = conn.execute("UPDATE chunks SET t_start=?, t_end=?, n_points=?, precision=?, data=? "
                           "WHERE id=? AND series_id=?", values + (chunk.chunk_id, series_id))
        if cur.rowcount == 1:
            return chunk.chunk_id
        # The open chunk is gone (retention deleted it, all its data older than the cutoff; its row id
        # may since hold another series' chunk): start a new one. Compaction rewrites only chunks
        # older than any open chunk (see store.compaction), so no point is doubled.
    cur = conn.execute("INSERT INTO chunks (series_id, t_start, t_end, n_points, precision, data) "
                       "VALUES (?,?,?,?,?,?)", (series_id,) + values)
    return int(cur.lastrowid)


class SeriesWriter:
    def __init__(self, chunk_points: int) -> None:
        self.chunk_points = chunk_points
        self.buffers: dict[str, _SeriesBuffer] = {}
        self._ids: dict[SeriesSpec, int] = {}

    def declare(self, spec: SeriesSpec) -> None:
        """Declare a series (idempotent; the latest declaration wins for new chunks)."""
        buf = self.buffers.get(spec.name)
        if buf is None:
            self.buffers[spec.name] = _SeriesBuffer(spec)
        elif buf.spec != spec:
            buf.seal()      # the open chunk keeps its precision; new points start a new one
            ratio = buf.spec.precision / spec.precision
            buf.new_points = [(t, round(q * ratio)) for t, q in buf.new_points]
            buf.spec = spec

    def append(self, name: str, t: float, value: float) -> None:
        """Buffer one point; undeclared catalogue names are declared on first use."""
        buf = self.buffers.get(name)
        if buf is None:
            spec = spec_for(name)
            if spec is None:
                raise ValueError(f"series {name!r} is not declared: call Store.declare(name, unit, "
                                 f"kind, precision) first, or add it to store/schema.py CATALOGUE")
            buf = self.buffers[name] = _SeriesBuffer(spec)
        if not math.isfinite(t):
            raise ValueError(f"series {name!r}: time {t!r} is not a finite Unix time in seconds")
        point = (round(t * 1000), to_fixed(value, buf.spec))
        try:
            codec.check_point(*point)
        except codec.CodecError as e:
            raise ValueError(f"series {name!r}: {e}") from None
        buf.new_points.append(point)

    def pending(self) -> Pending:
        """The points not yet written, per series with its open chunk (sealing stale ones first)."""
        now = time.monotonic()
        out = {}
        for name, buf in self.buffers.items():
            if buf.open_id is not None and now - buf.last_write > STALE_OPEN_S:
                buf.seal()
            if buf.new_points:
                out[name] = (buf.spec, buf.open_id, buf.encoder, list(buf.new_points))
        return out

    def encode(self, pending: Pending) -> Encoded:
        """The pending points as the chunk rows to write, before the transaction. The buffers' encoders
        are extended on copies, so a failed transaction leaves them as they were."""
        encoded: Encoded = {}
        for name, (spec, chunk_id, encoder, new_points) in pending.items():
            encoder = encoder.copy() if encoder is not None else codec.ChunkEncoder()
            chunks = []
            for point in new_points:
                if encoder.n == self.chunk_points:
                    chunks.append(EncodedChunk.of(encoder, spec.precision, chunk_id))
                    chunk_id, encoder = None, codec.ChunkEncoder()
                encoder.push(*point)
            chunks.append(EncodedChunk.of(encoder, spec.precision, chunk_id))
            encoded[name] = (spec, chunks, None if encoder.n == self.chunk_points else encoder)
        return encoded

    def write(self, conn: sqlite3.Connection, encoded: Encoded) -> Opened:
        """Write inside the caller's transaction; returns per series its new open chunk (id, encoder)."""
        opened: Opened = {}
        for name, (spec, chunks, encoder) in encoded.items():
            series_id = self._series_id(conn, spec)
            chunk_id = None
            for chunk in chunks:
                chunk_id = write_chunk(conn, series_id, chunk)
            opened[name] = (None, None) if encoder is None else (chunk_id, encoder)
        return opened

    def written(self, pending: Pending, opened: Opened) -> None:
        """The transaction committed: drop the written points, keep the open chunks."""
        now = time.monotonic()
        for name, (spec, _, _, new_points) in pending.items():
            buf = self.buffers[name]
            del buf.new_points[:len(new_points)]
            # redeclared meanwhile: that chunk keeps the old precision, so it stays sealed
            buf.open_id, buf.encoder = opened[name] if buf.spec == spec else (None, None)
            buf.last_write = now

    def failed(self) -> None:
        """The transaction rolled back: series ids it inserted are void."""
        self._ids.clear()

    def seal_all(self) -> None:
        """Never extend the open chunks again (compaction may merge them)."""
        for buf in self.buffers.values():
            buf.seal()

    def held(self) -> int:
        return sum(len(buf.new_points) for buf in self.buffers.values())

    def trim(self, limit: int) -> int:
        """Drop the oldest held points beyond `limit` per series; returns how many were dropped."""
        return sum(trim_oldest(buf.new_points, limit) for buf in self.buffers.values())

    def _series_id(self, conn: sqlite3.Connection, spec: SeriesSpec) -> int:
        if spec in self._ids:
            return self._ids[spec]
        conn.execute(
            "INSERT INTO series (name, unit, kind, precision, description) VALUES (?,?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET unit=excluded.unit, kind=excluded.kind, "
            "precision=excluded.precision, description=excluded.description",
            (spec.name, spec.unit, spec.kind, spec.precision, spec.description))
        self._ids[spec] = conn.execute("SELECT id FROM series WHERE name=?", (spec.name,)).fetchone()[0]
        return self._ids[spec]


def trim_oldest(items: list, limit: int) -> int:
    """Keep the newest `limit` items; returns how many were dropped."""
    excess = max(0, len(items) - limit)
    del items[:excess]
    return excess
