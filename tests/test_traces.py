"""Trace readers: the decode JSONL, prefill NPZ and recorded layouts, and their error messages."""
import json
from pathlib import Path

import numpy as np
import pytest

from agent.traces import (TraceError, access_sequence, from_sets, keys, load, parse_prompts, read_jsonl,
                          read_npz, walk)

DATA = Path(__file__).parent / "data" / "traces"
PREFILL = Path(__file__).parents[2] / "shared" / "traces" / "prefill" / "deepseek_v2_lite_puffin_0001-1000.npz"


def write_jsonl(path, meta, records):
    path.write_text("\n".join(json.dumps(r) for r in [{"meta": meta}, *records]) + "\n")
    return path


def meta(**over):
    return {"model": "tiny", "layers": 2, "top_k": 2, "n_experts": 8, **over}


@pytest.mark.parametrize("prompt", ["prose", "code", "math", "dialogue"])
def test_the_granite_traces_are_granite_3b_a800m_decode_routing(prompt):
    """The unseen architecture of BENCHMARKS.md's "A fourth architecture": 32 layers, 8 of 40 experts a step; the
    meta leaves n_experts null, so the ids say how many (simulate --experts 40 states it)."""
    t = read_jsonl(DATA / f"granite_{prompt}.jsonl")
    assert (t.n_tokens, t.n_layers, t.top_k, t.n_experts) == (512, 32, 8, 40)
    assert all(len(set(t.routed(step, layer).tolist())) == 8 for step in (0, 255, 511) for layer in (0, 31))


def test_decode_trace_reads_as_published():
    t = read_jsonl(DATA / "olmoe_math.jsonl")
    assert (t.name, t.n_tokens, t.n_layers, t.n_experts, t.top_k) == ("olmoe_math", 512, 16, 64, 8)
    assert t.dense().shape == (512, 16, 8)
    first = json.loads((DATA / "olmoe_math.jsonl").read_text().splitlines()[1])
    assert t.routed(0, 3).tolist() == first["routed"]["3"]
    assert t.session_starts.tolist() == [0]


def test_null_n_experts_is_inferred_or_taken_from_the_caller(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", meta(n_experts=None),
                    [{"step": 0, "routed": {"0": [1, 5], "1": [0, 2]}}])
    assert read_jsonl(p).n_experts == 6
    assert read_jsonl(p, n_experts=60).n_experts == 60
    with pytest.raises(TraceError, match=r"t\.jsonl:2: layer 0 expert id 5 is out of range for n_experts=4"):
        read_jsonl(p, n_experts=4)


def test_recorded_trace_with_batched_sets_and_sessions(tmp_path):
    records = [{"step": 0, "session": "a", "routed": {"0": [1, 2, 3], "1": [0, 4]}},
               {"step": 1, "session": "a", "routed": {"0": [2, 1], "1": [4, 5]}},
               {"step": 0, "session": "b", "routed": {"0": [7, 1], "1": [3, 6, 0, 2]}}]
    t = read_jsonl(write_jsonl(tmp_path / "rec.jsonl", meta(), records))
    assert t.session_starts.tolist() == [0, 2]
    assert t.max_set == 4 and t.routed(1, 0).tolist() == [2, 1]  # stored order kept
    assert [len(s) for s in t.rows()] == [3, 2, 2, 2, 2, 4]
    with pytest.raises(TraceError, match="different sizes"):
        t.dense()


@pytest.mark.parametrize("line, message", [
    ("{not json", r"t\.jsonl:3: not valid JSON"),
    (json.dumps({"step": 1}), r"t\.jsonl:3: expected"),
    (json.dumps({"step": 1, "routed": {"0": [1, 2]}}), r"t\.jsonl:3: routed layers \['0'\] do not match meta.layers=2"),
    (json.dumps({"step": 1, "routed": {"0": [1, 1], "1": [2, 3]}}), r"t\.jsonl:3: layer 0 lists an expert twice"),
    (json.dumps({"step": 1, "routed": {"0": [], "1": [2, 3]}}), r"t\.jsonl:3: layer 0 must be a non-empty list"),
    (json.dumps({"step": 1, "routed": {"0": [1, -2], "1": [2, 3]}}), r"t\.jsonl:3: layer 0 must be"),
    (json.dumps({"step": 1, "routed": {"0": [1, 99], "1": [2, 3]}}),
     r"t\.jsonl:3: layer 0 expert id 99 is out of range for n_experts=8"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, message):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"meta": meta()}) + "\n"
                 + json.dumps({"step": 0, "routed": {"0": [1, 2], "1": [3, 4]}}) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message):
        read_jsonl(p)


@pytest.mark.parametrize("first, message", [
    ("", r"t\.jsonl:1: the first line must be"),
    (json.dumps({"meta": meta(layers=0)}), r"t\.jsonl:1: meta.layers must be a positive integer"),
    (json.dumps({"meta": meta(top_k="8")}), r"meta.top_k must be a positive integer"),
    (json.dumps({"meta": meta(n_experts=-1)}), r"meta.n_experts must be a positive integer or null"),
    (json.dumps({"meta": None}), r"t\.jsonl:1: meta must be a JSON object \{...\}, got null"),  # AttributeError
    (json.dumps({"meta": [1]}), r"t\.jsonl:1: meta must be a JSON object \{...\}, got \[1\]"),
    (json.dumps({"meta": "x"}), r't\.jsonl:1: meta must be a JSON object \{...\}, got "x"'),
    (json.dumps({"meta": meta(n_experts=True)}), r"meta.n_experts must be a positive integer or null"),
    (json.dumps({"meta": meta(layers=65537)}), r"meta.layers must be a positive integer \(at most 65536\)"),
    (json.dumps({"meta": meta(top_k=9)}), r"meta.top_k=9 exceeds meta.n_experts=8"),
    (json.dumps({"meta": meta(model=["m"])}), r"meta.model must be a string or null, got \['m'\]"),
])
def test_bad_meta_line(tmp_path, first, message):
    p = tmp_path / "t.jsonl"
    p.write_text(first + "\n")
    with pytest.raises(TraceError, match=message):
        read_jsonl(p)


@pytest.mark.parametrize("sample, message", [
    ('{"layer": 0, "read_latency_s": %s}' % ("9" * 400), "layer 0: a monitoring sample must be"),  # OverflowError
    ('{"layer": 0, "read_latency_s": NaN}', r"layer 0: .*each a finite number >= 0; got .*NaN"),  # all 4 were read
    ('{"layer": 1, "read_latency_s": Infinity}', "layer 1: .*each a finite number >= 0"),
    ('{"layer": 0, "mem_pressure": 1e400}', "layer 0: .*got .*Infinity"),
    ('{"layer": 0, "read_latency_s": -0.5}', "layer 0: .*each a finite number >= 0"),
    ('{"layer": 0}', r"layer 0: a monitoring sample must be .* with at least one value.*; got \{\}"),
    ('{}', r'"system" must be a list of \{"layer": L \(0\.\.1, each once\)'),
    ('{"layer": true, "read_latency_s": 0.1}', r'"system" must be a list of'),
])
def test_bad_system_samples_name_file_line_and_layer(tmp_path, sample, message):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"meta": meta()}) + '\n{"step": 0, "routed": {"0": [1, 2], "1": [3, 4]}, "system": ['
                 + sample + "]}\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: (\"system\" )?{message}"):
        read_jsonl(p)


def test_json_the_parser_gives_up_on_names_the_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    for line, error in [("[" * 100_000, "RecursionError"), ('{"step": %s}' % ("9" * 5000), "ValueError")]:
        p.write_text(json.dumps({"meta": meta()}) + "\n" + line + "\n")
        with pytest.raises(TraceError, match=rf"t\.jsonl:2: not JSON this reader takes \({error}"):
            read_jsonl(p)


def test_missing_file_unknown_layout_and_header_only(tmp_path):
    for absent in ("absent.jsonl", "absent.npz", "absent"):   # "absent" was an "unknown trace layout"
        with pytest.raises(TraceError, match=f"{absent}: no such trace file"):
            load(tmp_path / absent)
    (tmp_path / "t.csv").write_text("layer,expert\n")
    with pytest.raises(TraceError, match="unknown trace layout"):
        load(tmp_path / "t.csv")
    with pytest.raises(TraceError, match="no routing records"):
        read_jsonl(write_jsonl(tmp_path / "h.jsonl", meta(), []))


def write_npz(path, **over):
    ids = np.array([[[1, 2], [3, 4]], [[2, 5], [0, 4]], [[6, 1], [2, 3]]], dtype=np.uint8)  # [3 tokens, 2, 2]
    arrays = dict(expert_ids=ids, prompt_offsets=np.array([0, 2, 3]), prompt_numbers=np.array([4, 9], np.int32),
                  layers=np.array([1, 2], np.int16),
                  meta=np.array(json.dumps({"model": "m", "layers": 2, "top_k": 2, "n_experts": 8})))
    arrays.update(over)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_npz_prompts_are_sessions_and_ranges_select_them(tmp_path):
    p = write_npz(tmp_path / "p.npz")
    t = read_npz(p)
    assert (t.n_tokens, t.n_layers, t.top_k, t.n_experts, t.layer_ids) == (3, 2, 2, 8, (1, 2))
    assert t.session_starts.tolist() == [0, 2]
    only = load(p, prompts=parse_prompts("5..9"))
    assert only.name == "p[5..9]" and only.dense().tolist() == [[[6, 1], [2, 3]]]
    with pytest.raises(TraceError, match=r"no prompt numbered 10\.\.12"):
        read_npz(p, range(10, 13))


def test_a_prompt_range_of_any_width_selects_by_its_bounds(tmp_path):
    """`--prompts 1..99999999999` listed every number of the range: a MemoryError traceback."""
    p = write_npz(tmp_path / "p.npz")
    assert load(p, prompts=parse_prompts("1..99999999999")).n_tokens == 3
    assert load(p, prompts=parse_prompts("9..99999999999999999999999")).dense().tolist() == [[[6, 1], [2, 3]]]
    with pytest.raises(TraceError, match=r"no prompt numbered 10\.\.99999999999 "):
        read_npz(p, parse_prompts("10..99999999999"))


@pytest.mark.parametrize("over, message", [
    ({"prompt_offsets": None}, r"missing array\(s\) \['prompt_offsets'\]"),
    ({"prompt_offsets": np.array([0, 2, 5])}, "array prompt_offsets must rise from 0 to 3"),
    ({"prompt_numbers": np.array(5)}, r"both 1-d \(shapes \(3,\) and \(\)\)"),
    ({"expert_ids": np.zeros((3, 2), np.uint8)}, "array expert_ids must be"),
    ({"expert_ids": np.array([[[1, 2], [3, 4]], [[2, 5], [0, 4]], [[6, 1], [3, 3]]], np.uint8)},
     r"p\.npz: expert_ids\[2\]: layer 1 lists an expert twice: \[3, 3\]"),  # was replayed (exit 0)
    ({"layers": np.array([1, 2, 3], np.int16)}, "array layers has shape"),
    ({"meta": np.array("{oops")}, "array meta: not valid JSON"),
    ({"meta": np.array("[1]")}, r"p\.npz: meta must be a JSON object \{...\}, got \[1\]"),  # was AttributeError
    ({"meta": np.array('{"n_experts": "abc"}')}, "p\\.npz: meta.n_experts must be a positive integer or null"
                                                 " \\(at most 2147483647\\), got 'abc'"),  # was TypeError
    ({"meta": np.array('{"n_experts": 8, "model": 5}')}, "meta.model must be a string or null, got 5"),
    ({"meta": np.array('{"n_experts": 8, "layers": 4}')},   # was read as the array's 2 layers (exit 0)
     r"p\.npz: meta\.layers=4 but array expert_ids \[tokens, layers, k\] has 2 layers \(shape \(3, 2, 2\)\)"),
    ({"meta": np.array('{"n_experts": 8, "layers": 2, "top_k": 6}')},
     r"p\.npz: meta\.top_k=6 but array expert_ids \[tokens, layers, k\] has 2 experts per set \(k\) \(shape"),
])
def test_malformed_npz_names_the_array(tmp_path, over, message):
    with pytest.raises(TraceError, match=message):
        read_npz(write_npz(tmp_path / "p.npz", **over))


def flipped(whole: bytes) -> bytes:
    """`whole` with one byte of its first member's compressed data flipped."""
    return whole[:100] + bytes([whole[100] ^ 0xFF]) + whole[101:]


@pytest.mark.parametrize("damage, message", [
    (lambda whole: b"not a zip", "not an NPZ archive: it does not begin as a zip archive does"),
    (lambda whole: b"", "not an NPZ archive: the file is empty"),                           # was EOFError
    (lambda whole: np.lib.format.magic(1, 0), "not an NPZ archive: it does not begin as a"),  # a .npy
    (lambda whole: whole[:len(whole) // 2], r"not a readable NPZ archive, it is damaged or cut short "
                                              r"\(BadZipFile"),                             # was BadZipFile
    (flipped, "not a readable NPZ archive, it is damaged or cut short"),                    # was zlib.error
])
def test_not_an_npz(tmp_path, damage, message):
    np.savez_compressed(tmp_path / "c.npz", **np.load(write_npz(tmp_path / "w.npz")))  # as published
    p = tmp_path / "x.npz"
    p.write_bytes(damage((tmp_path / "c.npz").read_bytes()))
    with pytest.raises(TraceError, match=rf"x\.npz: {message}"):
        read_npz(p)


def test_a_directory_named_npz_is_not_read(tmp_path):
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(TraceError, match=r"d\.npz: cannot read as an NPZ archive .*Is a directory"):
        read_npz(tmp_path / "d.npz")


def test_prompt_range_syntax():
    assert parse_prompts("801..1000") == range(801, 1001)
    for bad in ("801-1000", "9..3", "a..b"):
        with pytest.raises(TraceError, match="prompt range"):
            parse_prompts(bad)


def test_access_sequence_is_the_replay_order():
    t = from_sets([[[3, 1], [2]], [[0], [5, 4, 6]]], session_starts=[0, 1])
    walked = [(new, layer, experts) for new, layer, experts in walk(t)]
    assert walked == [(True, 0, [3, 1]), (False, 1, [2]), (True, 0, [0]), (False, 1, [5, 4, 6])]
    assert keys(access_sequence(t)) == [(0, 3), (0, 1), (1, 2), (0, 0), (1, 5), (1, 4), (1, 6)]


def test_real_prefill_report_split():
    if not PREFILL.exists():
        pytest.skip("../shared/traces is absent (the prefill NPZ is not redistributed)")
    t = read_npz(PREFILL, parse_prompts("801..1000"))
    assert (t.n_layers, t.top_k, t.n_experts) == (26, 6, 64)
    assert len(t.session_starts) == 200 and t.n_tokens == 16080
    assert t.layer_ids[0] == 1 and t.layer_ids[-1] == 26
