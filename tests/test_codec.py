"""The 8-bit delta codec: lossless round trips, compactness on steady series, clear errors."""
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from store import codec
from store.codec import CodecError, decode, encode
from store.series_writer import to_fixed
from store.schema import SeriesSpec

LIMIT = (1 << 62) - 1
times = st.lists(st.integers(-(2**60) + 1, 2**60 - 1), min_size=1, max_size=100)


@st.composite
def chunks(draw):
    """Mostly regular 1 Hz ticks and value steps (small, or busy: thousands or millions of steps),
    with runs and rare huge jumps mixed in (hypothesis picks the shape and a seed; numpy draws the
    bulk, which keeps generation fast)."""
    n = draw(st.integers(1, 400))
    jitter, jumps, flat = (draw(st.floats(0, 1)) for _ in range(3))
    scale = draw(st.sampled_from([130, 130, 5000, 10**6]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    steps = np.where(rng.random(n - 1) < jitter, rng.integers(0, 1100, n - 1), 1000)
    steps = np.where(rng.random(n - 1) < jumps / 20, rng.integers(0, 10**9, n - 1), steps)
    deltas = np.where(rng.random(n - 1) < flat, 0, rng.integers(-scale, scale + 1, n - 1))
    deltas = np.where(rng.random(n - 1) < jumps / 10, rng.integers(-10**15, 10**15, n - 1), deltas)
    t0 = draw(st.integers(0, 2_000_000_000_000))
    q0 = draw(st.integers(-10**15, 10**15))
    return np.cumsum(np.r_[t0, steps]).tolist(), np.cumsum(np.r_[q0, deltas]).tolist()


@settings(max_examples=150, deadline=None)
@given(chunks())
def test_round_trip_is_exact(chunk):
    t, q = chunk
    decoded = decode(encode(t, q))
    assert decoded.t_ms.tolist() == t
    assert decoded.q.tolist() == q


@settings(max_examples=100, deadline=None)
@given(times, st.data())
def test_round_trip_of_arbitrary_times_and_values(t, data):
    q = data.draw(st.lists(st.integers(-LIMIT, LIMIT), min_size=len(t), max_size=len(t)))
    decoded = decode(encode(t, q))
    assert decoded.t_ms.tolist() == t and decoded.q.tolist() == q


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e9, 1e9, allow_nan=False), st.sampled_from([1e-5, 0.001, 0.01, 0.1, 1.0, 512.0, 1024.0]))
def test_values_are_lossless_within_half_the_precision(value, precision):
    spec = SeriesSpec("x", "u", "gauge", precision)
    q = to_fixed(value, spec)
    back = decode(encode([0], [q])).q[0] * precision
    # exact arithmetic gives <= precision / 2; the float product q * precision adds up to an ulp
    # of the value (e.g. 268435456.640625 at 1e-05, a tie, came back 5.0068e-06 away)
    assert abs(back - value) <= precision / 2 * (1 + 1e-9) + 2 * np.spacing(abs(value))


@given(st.integers(0, (1 << 62) - 1))
def test_integer_counters_are_exact_beyond_float_precision(count):
    spec = SeriesSpec("c", "B", "counter", 1.0)
    assert decode(encode([0, 1000], [0, to_fixed(count, spec)])).q[1] == count
    assert to_fixed(np.int64(count), spec) == count


def test_steady_1hz_series_costs_well_under_a_byte_per_point():
    t = [1_700_000_000_000 + 1000 * i for i in range(120)]
    data = encode(t, [42] * 120)
    assert len(data) / 120 < 0.25
    assert decode(data).q.tolist() == [42] * 120


def test_small_steps_cost_one_byte_each_and_a_rare_large_one_escapes():
    t = [1000 * i for i in range(10)]
    small = encode(t, [0, 5, -95] + [-95] * 7)
    large = encode(t, [0, 5, 100_005] + [100_005] * 7)
    assert len(large) - len(small) == 3          # a 3-byte zigzag varint beside its escape code
    assert decode(large).q.tolist()[2] == 100_005
    with pytest.raises(CodecError, match="not a chunk of format"):
        decode(b"\x01" + large[1:])


def test_streams_of_mostly_large_deltas_drop_the_escape_bytes():
    t = [1000 * i for i in range(100)]
    q = np.cumsum(np.random.default_rng(1).integers(-5000, 5000, 100)).tolist()
    data = encode(t, q)
    assert len(data) < 100 * 2.2          # 2-byte varints, not escape + varint (3 bytes each)
    assert decode(data).q.tolist() == q


def test_format_2_chunks_still_decode():
    #          fmt  n   t0  v0 | times: codes<<0, exc, runs, ESC, zigzag(1000) | values: 1 code: +5
    chunk = bytes([2, 2, 0, 0, 1, 1, 0, 0x80, 0xD0, 0x0F, 1, 0, 0, 5])
    decoded = decode(chunk)
    assert decoded.t_ms.tolist() == [0, 1000] and decoded.q.tolist() == [0, 5]


def test_reserved_codes_are_escaped_not_misread():
    t = [1000 * i for i in range(4)]
    q = [0, codec.ESC, codec.ESC + codec.RUN, 0]       # deltas -128, -127, +128
    assert decode(encode(t, q)).q.tolist() == q


def test_a_long_run_is_one_code():
    n = 100_000
    t = [1000 * i for i in range(n)]
    data = encode(t, [7] * n)
    assert len(data) < 30
    assert decode(data).t_ms.tolist() == t


@pytest.mark.parametrize("t,q,message", [
    ([], [], "need >= 1 point"),
    ([0, 1], [0], "equal lengths"),
    ([0], [1 << 62], "coarser precision"),
    ([1 << 60], [0], "within \\+-2\\*\\*60"),
])
def test_bad_input_is_named(t, q, message):
    with pytest.raises(CodecError, match=message):
        encode(t, q)


def test_truncated_or_corrupt_chunks_raise_codec_error():
    data = encode([1000 * i for i in range(50)], [i * i for i in range(50)])
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(CodecError):
            decode(data[:cut])
    with pytest.raises(CodecError, match="left over"):
        decode(data + b"\x00")


def test_non_finite_values_are_rejected_by_name():
    with pytest.raises(ValueError, match="not finite"):
        to_fixed(math.nan, SeriesSpec("block.vda.util", "fraction"))


def test_every_recorded_series_round_trips_exactly():
    """The series the collector recorded on this machine (tests/data/recorded_series.json)."""
    import json
    from pathlib import Path
    fixture = json.loads((Path(__file__).parent / "data" / "recorded_series.json").read_text())
    assert len(fixture["series"]) >= 12
    for name, entry in fixture["series"].items():
        t_ms = np.cumsum([fixture["t0_ms"]] + entry["dt_ms"])[1:].tolist()
        for start in range(0, len(t_ms), 120):                      # the writer's chunks
            decoded = decode(encode(t_ms[start:start + 120], entry["q"][start:start + 120]))
            assert decoded.t_ms.tolist() == t_ms[start:start + 120], name
            assert decoded.q.tolist() == entry["q"][start:start + 120], name


@settings(max_examples=50, deadline=None)
@given(chunks())
def test_an_open_chunk_extended_point_by_point_equals_the_chunk_encoded_at_once(chunk):
    t, q = chunk
    encoder = codec.ChunkEncoder()
    for i, (ti, qi) in enumerate(zip(t, q)):
        encoder.push(ti, qi)
        if i % 17 == 0 or i == len(t) - 1:
            assert encoder.to_bytes() == encode(t[:i + 1], q[:i + 1])
    twin = encoder.copy()
    twin.push(t[-1] + 1000, q[-1] + 1)
    assert encoder.to_bytes() == encode(t, q)                     # the copy did not touch it
    assert decode(twin.to_bytes()).q.tolist() == q + [q[-1] + 1]


# --- format 4: the third stream layout (mode 2, exp-Golomb of a per-stream order k) -----------

def _stream_modes(data: bytes) -> tuple[int, int]:
    """The (times, values) stream modes of a format-4 chunk, by decoding it piece by piece."""
    pos = 1
    for _ in range(3):
        _, pos = codec._read_varint(data, pos)
    head_t, _ = codec._read_varint(data, pos)
    _, after_t = codec._decode_stream(data, pos, 4)
    head_v, _ = codec._read_varint(data, after_t)
    return head_t & 3, head_v & 3


def _chunk_with_golomb_values(t: list[int], q: list[int], k: int) -> bytes:
    """A format-4 chunk whose values stream is forced into mode 2 at order k."""
    encoder = codec.ChunkEncoder.of(t, q)
    out = bytearray([codec.FORMAT])
    codec._varint(encoder.n, out)
    codec._varint(codec._zigzag(encoder.t0), out)
    codec._varint(codec._zigzag(encoder.q0), out)
    encoder.times.write(out)
    return bytes(out + encoder.values.golomb_stream(k))


def test_busy_series_use_the_golomb_layout_and_cost_under_two_bytes():
    t = [1000 * i for i in range(600)]
    q = np.cumsum(np.random.default_rng(2).integers(-5000, 5000, 600)).tolist()
    data = encode(t, q)
    assert data[0] == codec.FORMAT == 4
    assert _stream_modes(data) == (codec.BYTES, codec.GOLOMB)
    assert len(data) < 600 * 1.85          # ~14.4 bits a delta, where a zigzag varint takes 2 bytes
    assert decode(data).q.tolist() == q


def test_quiet_series_keep_the_byte_layout_and_small_steps_take_the_smallest():
    t = [1000 * i for i in range(200)]
    assert _stream_modes(encode(t, [5] * 200)) == (codec.BYTES, codec.BYTES)
    steps = [5 + 3 * (i // 50) for i in range(200)]                 # a step every 50 s
    assert _stream_modes(encode(t, steps)) == (codec.BYTES, codec.BYTES)
    small = np.cumsum(np.random.default_rng(3).integers(-20, 21, 200)).tolist()
    data = encode(t, small)         # ~5.4 bits of entropy a delta: mode 2 beats a byte each
    assert _stream_modes(data) == (codec.BYTES, codec.GOLOMB) and len(data) < 200
    assert decode(data).q.tolist() == small


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-LIMIT, LIMIT), min_size=1, max_size=60), st.integers(0, codec.MAX_K))
def test_golomb_layout_round_trips_at_every_order_even_64_bit_deltas(q, k):
    q = q + [LIMIT, -LIMIT, LIMIT - 1, 0]          # deltas of +-(2**63 - 2): zigzags near 2**64
    t = [1000 * i for i in range(len(q))]
    decoded = decode(_chunk_with_golomb_values(t, q, k))
    assert decoded.q.tolist() == q and decoded.t_ms.tolist() == t


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**63) + 1, 2**63 - 1), max_size=40))
def test_golomb_sizes_are_exact_for_every_order(deltas):
    """The encoder picks k from counts alone; they must predict every order's bytes exactly."""
    stream = codec.StreamEncoder()
    for d in deltas:
        stream.push(d)
    sizes = stream.golomb_sizes()
    for k in range(codec.MAX_K + 1):
        data = bytes(stream.golomb_stream(k))
        _, order_at = codec._read_varint(data, 0)                  # head, then k
        _, sections_at = codec._read_varint(data, order_at + 1)     # n_prefix_bytes, then bits
        assert len(data) - sections_at == sizes[k], k
        zigzags, end = codec._decode_golomb(data, order_at, len(deltas))
        assert end == len(data)
        assert codec._unzigzag_array(zigzags).tolist() == deltas


def test_a_copy_extended_does_not_change_the_original_golomb_sections():
    t = [1000 * i for i in range(300)]
    q = np.cumsum(np.random.default_rng(4).integers(-9000, 9000, 300)).tolist()
    encoder = codec.ChunkEncoder.of(t[:200], q[:200])
    before = encoder.to_bytes()
    twin = encoder.copy()
    for i in range(200, 300):
        twin.push(t[i], q[i])
        twin.to_bytes()
    assert encoder.to_bytes() == before == encode(t[:200], q[:200])
    encoder.push(t[200], q[200] + 77_777)
    assert decode(encoder.to_bytes()).q.tolist() == q[:200] + [q[200] + 77_777]
    assert twin.to_bytes() == encode(t, q)


def test_format_3_chunks_still_decode():
    """Written by the format-3 encoder (commit f55cfdd): one chunk with a byte-mode values stream,
    one with a varint-mode one; both with a jittered tick in the times."""
    t = [1000 * i for i in range(12)]
    t[5] += 7
    byte_mode = bytes.fromhex("030c00000c0102808107f20781d00f0304170ac701000000889c0c000000c39a0c00")
    assert decode(byte_mode).t_ms.tolist() == t
    assert decode(byte_mode).q.tolist() == [0, 5, -95, -95, -95, -95, 100005, 100005, 100005, 100005, 3, 3]
    varint_mode = bytes.fromhex("030c00000c0102808107f20781d00f030417d08c018fcb01c0c70f02e1ce17e0c5"
                                "080202bca90700c1a907")
    assert decode(varint_mode).t_ms.tolist() == t
    assert decode(varint_mode).q.tolist() == [0, 9000, -4000, 123456, 123457, -70000, 0, 1, 2,
                                              60000, 60000, -1]


def test_truncated_or_corrupt_golomb_chunks_raise_codec_error():
    t = [1000 * i for i in range(80)]
    q = np.cumsum(np.random.default_rng(5).integers(-20000, 20000, 80)).tolist()
    data = encode(t, q)
    assert _stream_modes(data)[1] == codec.GOLOMB
    for cut in range(1, len(data)):
        with pytest.raises(CodecError):
            decode(data[:cut])
    with pytest.raises(CodecError, match="left over"):
        decode(data + b"\x00")
    with pytest.raises(CodecError, match="not a chunk of format"):
        decode(b"\x05" + data[1:])


@st.composite
def series_runs(draw):
    """An arbitrary series as a writer makes it: a precision, points in any time order (ties too),
    values anywhere within the codec's range at that precision, and where the flushes fall."""
    precision = draw(st.sampled_from([1e-6, 1e-4, 0.01, 0.1, 1.0, 4096.0]))
    bound = min(1e12, precision * 2.0**52)
    n = draw(st.integers(1, 120))
    t = draw(st.lists(st.integers(1_600_000_000_000, 1_600_000_600_000), min_size=n, max_size=n))
    v = draw(st.lists(st.floats(-bound, bound, allow_nan=False), min_size=n, max_size=n))
    flushes = draw(st.sets(st.integers(0, n - 1), max_size=8))
    return precision, t, v, flushes, draw(st.integers(2, 40))


@settings(max_examples=60, deadline=None)
@given(series_runs())
def test_any_series_written_through_the_store_reads_back_within_half_its_precision(run):
    """The whole path: Store.append, open chunks rewritten on each flush and sealed at chunk_points,
    SQLite, store.queries.points."""
    from store import queries
    from store.db import Store
    precision, t_ms, values, flushes, chunk_points = run
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "flashmoe.db"
        with Store(db, autoflush_s=0, chunk_points=chunk_points) as store:
            store.declare("any.series", "u", precision=precision)
            for i, (t, v) in enumerate(zip(t_ms, values)):
                store.append("any.series", t / 1000, v)
                if i in flushes:
                    assert store.flush()
        t_back, v_back = queries.points(db, "any.series")
    # read back oldest first; points of one time may come in another order (rounding keeps their order by value)
    t_back = (t_back * 1000).round().astype(int)
    back = sorted(zip(t_back.tolist(), v_back.tolist()))
    expected = sorted(zip(t_ms, values))
    assert [t for t, _ in back] == [t for t, _ in expected]
    v_back, v_expected = np.array([v for _, v in back]), np.array([v for _, v in expected])
    assert np.all(np.abs(v_back - v_expected) <= precision / 2 * (1 + 1e-9) + 4 * np.spacing(np.abs(v_expected)))
