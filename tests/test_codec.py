"""The 8-bit delta codec: lossless round trips, compactness on steady series, clear errors."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from store import codec
from store.codec import CodecError, decode, encode
from store.db import to_fixed
from store.schema import SeriesSpec

LIMIT = (1 << 62) - 1
times = st.lists(st.integers(-(2**60) + 1, 2**60 - 1), min_size=1, max_size=100)


@st.composite
def chunks(draw):
    """Mostly regular 1 Hz ticks and small value steps, with runs and rare huge jumps mixed in
    (hypothesis picks the shape and a seed; numpy draws the bulk, which keeps generation fast)."""
    n = draw(st.integers(1, 400))
    jitter, jumps, flat = (draw(st.floats(0, 1)) for _ in range(3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    steps = np.where(rng.random(n - 1) < jitter, rng.integers(0, 1100, n - 1), 1000)
    steps = np.where(rng.random(n - 1) < jumps / 20, rng.integers(0, 10**9, n - 1), steps)
    deltas = np.where(rng.random(n - 1) < flat, 0, rng.integers(-130, 131, n - 1))
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
    assert abs(back - value) <= precision / 2 * (1 + 1e-9)


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
