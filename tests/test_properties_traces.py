"""Hypothesis: the trace readers round-trip any valid routing, and answer any damaged file (a line
replaced by arbitrary JSON or text, arbitrary NPZ arrays, an NPZ archive cut short or overwritten)
with a Trace or a TraceError naming the file, never another exception."""
from __future__ import annotations

import contextlib
import io
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agent.simulator import SystemReplay
from agent.traces import TraceError, read_jsonl, read_npz

T = TypeVar("T")

# numbers no monitoring sample may hold (1e400 parses to infinity; a 400-digit integer has no float), among any
numbers = st.floats() | st.integers() | st.sampled_from([10**400, -10**400, 1e400, -1.0, float("nan")])
samples = st.dictionaries(st.sampled_from(["read_latency_s", "mem_pressure", "ssd_util"]),
                          st.floats(0, 1) | numbers | st.text(max_size=3), max_size=3)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=4), max_leaves=12)


@st.composite
def routings(draw) -> tuple[dict, list[dict]]:
    """A decode-layout trace: meta, then per token a non-empty set of distinct experts per layer."""
    n_layers, n_experts = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    top_k = draw(st.integers(1, n_experts))
    sets = st.lists(st.integers(0, n_experts - 1), min_size=1, max_size=n_experts, unique=True)
    records = [{"step": step, "session": draw(st.integers(0, 2)),
                "routed": {str(layer): draw(sets) for layer in range(n_layers)}}
               for step in range(draw(st.integers(1, 8)))]
    return {"model": "fuzz", "layers": n_layers, "top_k": top_k, "n_experts": n_experts}, records


def metas(valid: dict) -> st.SearchStrategy:
    """A meta of any JSON type, or `valid` with one field of any JSON value (a list, a string, a huge count)."""
    count = json_values | st.integers(-2, 70_000)  # past the reader's layer limit, yet small enough to build
    fields = {"model": json_values, "layers": count, "top_k": count | st.just(2**31),
              "n_experts": count | st.just(2**31)}
    return json_values | st.one_of(*(v.map(lambda v, f=f: {**valid, f: v}) for f, v in fields.items()))


@contextlib.contextmanager
def written(name: str, content: str | bytes) -> Iterator[Path]:
    """`content` in a fresh file (hypothesis runs many examples per test: no function-scoped tmp_path)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        yield path


def read_or_refused(name: str, content: str | bytes, reader: Callable[[Path], T], refusal=TraceError) -> T | None:
    """reader's result for `content` written to a file `name`, or None when it refused it naming the file."""
    with written(name, content) as path:
        try:
            return reader(path)
        except refusal as err:
            assert str(path) in str(err)
            return None


def jsonl(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


@given(routings())
def test_a_valid_jsonl_trace_reads_back_as_written(routing):
    meta, records = routing
    with written("trace.jsonl", jsonl([json.dumps({"meta": meta}), *map(json.dumps, records)])) as path:
        trace = read_jsonl(path)
    assert trace.rows() == [r["routed"][str(layer)] for r in records for layer in range(meta["layers"])]
    opened = [i for i, r in enumerate(records) if i == 0 or r["session"] != records[i - 1]["session"]]
    assert trace.session_starts.tolist() == opened


@given(routings(), st.data())
def test_a_damaged_jsonl_line_is_a_trace_error_naming_the_file(routing, data):
    meta, records = routing
    lines = [json.dumps({"meta": meta}), *map(json.dumps, records)]
    where = data.draw(st.integers(0, len(lines) - 1))
    lines[where] = data.draw(st.text(max_size=40) | json_values.map(json.dumps) | st.builds(
        lambda r, v: json.dumps({**r, "routed": v}), st.just(records[0]), json_values))
    with written("trace.jsonl", jsonl(lines)) as path:
        try:
            read_jsonl(path)
        except TraceError as err:
            assert str(path) in str(err)


@given(routings(), st.data())
def test_any_meta_is_a_trace_or_a_trace_error_naming_the_file(routing, data):
    meta, records = routing
    drawn = data.draw(metas(meta))
    trace = read_or_refused("trace.jsonl", jsonl([json.dumps({"meta": drawn}), *map(json.dumps, records)]), read_jsonl)
    assert trace is None or isinstance(drawn, dict) and isinstance(trace.model, str) and trace.top_k >= 1
    assert trace is None or drawn.get("n_experts") is None or trace.top_k <= trace.n_experts == drawn["n_experts"]


arrays = hnp.arrays(st.sampled_from([np.int8, np.int32, np.int64, np.float32, np.uint16]),
                    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))


@given(st.dictionaries(st.sampled_from(["expert_ids", "prompt_offsets", "prompt_numbers", "layers", "meta"]),
                       arrays | st.text(max_size=20).map(np.array), min_size=3))
def test_arbitrary_npz_arrays_are_a_trace_or_a_trace_error(contents):
    buffer = io.BytesIO()
    np.savez(buffer, **contents)
    with written("trace.npz", buffer.getvalue()) as path:
        try:
            trace = read_npz(path)
        except TraceError as err:
            assert str(path) in str(err)
            return
    assert trace.n_tokens >= 1 and trace.experts.min() >= 0


def npz_bytes(compressed: bool) -> bytes:
    """A small valid prefill archive (the published one is compressed)."""
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(
        buffer, expert_ids=np.array([[[1, 2]], [[0, 3]]], np.uint8), prompt_offsets=np.array([0, 1, 2]),
        prompt_numbers=np.array([1, 2]), layers=np.array([1]), meta=np.array(json.dumps({"n_experts": 4})))
    return buffer.getvalue()


@st.composite
def damaged_archives(draw) -> bytes:
    """A valid archive cut short, or with a span overwritten, or arbitrary bytes that may begin as a zip does."""
    whole = npz_bytes(draw(st.booleans()))
    at = draw(st.integers(0, len(whole) - 1))
    return draw(st.sampled_from([
        whole[:at],
        whole[:at] + draw(st.binary(min_size=1, max_size=8)) + whole[at + 8:],
        draw(st.sampled_from([b"", b"PK\x03\x04"])) + draw(st.binary(max_size=64)),
    ]))


@given(damaged_archives())
def test_a_damaged_npz_archive_is_a_trace_or_a_trace_error(content):
    read_or_refused("trace.npz", content, read_npz)


@st.composite
def prefills(draw, meta: Callable[[dict], st.SearchStrategy]) -> dict[str, np.ndarray]:
    """A prefill-layout archive's arrays with a meta drawn from `meta(the valid one)` and a routing whose sets are
    distinct experts, but for some that name one twice (which the JSONL reader refuses, and the NPZ reader took)."""
    tokens, n_layers, k = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    valid = {"model": "m", "layers": n_layers, "top_k": k, "n_experts": 8}
    ids = [draw(st.permutations(range(8)))[:k] for _ in range(tokens * n_layers)]
    for row in draw(st.lists(st.integers(0, len(ids) - 1), max_size=2)) if k > 1 else []:
        ids[row][-1] = ids[row][0]
    cuts = sorted(draw(st.lists(st.integers(0, tokens), max_size=3)))
    return dict(expert_ids=np.array(ids, np.uint8).reshape(tokens, n_layers, k),
                prompt_offsets=np.array([0, *cuts, tokens]), prompt_numbers=np.arange(1, len(cuts) + 2),
                layers=np.arange(1, n_layers + 1), meta=np.array(json.dumps(draw(meta(valid)))))


def npz_of(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@given(prefills(metas))
def test_an_npz_with_any_meta_or_a_set_naming_an_expert_twice_is_a_trace_or_a_trace_error(arrays):
    trace = read_or_refused("trace.npz", npz_of(arrays), read_npz)
    if trace is None:
        return
    meta = json.loads(str(arrays["meta"]))
    assert isinstance(meta, dict) and isinstance(trace.model, str) and trace.n_experts >= trace.experts.max() + 1
    assert meta.get("n_experts") in (None, trace.n_experts)
    assert meta.get("layers") in (None, trace.n_layers) and meta.get("top_k") in (None, trace.top_k)
    assert all(len(set(row)) == len(row) for row in trace.rows())


def fed(sample: dict[str, float]) -> bool:
    """What a policy may be fed: at least one signal, each a finite float >= 0."""
    return bool(sample) and all(isinstance(v, float) and np.isfinite(v) and v >= 0 for v in sample.values())


@given(routings(), samples)
def test_a_recorded_system_sample_is_refused_or_finite(routing, sample):
    meta, records = routing
    records[0] = {**records[0], "system": [{"layer": 0, **sample}]}
    trace = read_or_refused("trace.jsonl", jsonl([json.dumps({"meta": meta}), *map(json.dumps, records)]), read_jsonl)
    assert trace is None or fed(trace.system[0])


@given(st.fixed_dictionaries({}, optional={"every": numbers | json_values, "samples": st.lists(samples, max_size=3)}))
def test_a_system_series_is_refused_or_finite(doc):
    series = read_or_refused("series.json", json.dumps(doc), SystemReplay.load, ValueError)
    assert series is None or (series.samples and all(map(fed, series.samples))
                              and type(series.every) is int and series.every >= 1)
