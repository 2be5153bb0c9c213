"""bench/scale.py on a small shape: the compute-only bound, one configuration inside a real cgroup
limit, the limit arithmetic and the summary over rounds (the 13 GB runs are benches, not tests)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_route_trace import records, write_trace
from test_shapes import tiny

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from agent import bf16_matvec  # noqa: E402
from agent.convert import convert  # noqa: E402
from agent.shapes import write_checkpoint  # noqa: E402
from agent.experts.layout import EXPERTS, INDEX, Index  # noqa: E402
from bench import loader, quant_scale, scale  # noqa: E402
from bench.memory import MemoryCgroup, device_memory  # noqa: E402


@pytest.fixture(scope="module")
def shaped(tmp_path_factory) -> tuple[Path, list[Path]]:
    """OLMoE's shape cut small (2 layers x 16 experts, top-8) and a trace that fits it."""
    tmp = tmp_path_factory.mktemp("scale")
    config = {**tiny("olmoe-1b-7b"), "num_experts_per_tok": 2}
    convert(write_checkpoint(config, tmp / "hf"), tmp / "store", quantize=None)
    sets = [[sorted({(t + l) % 16, (5 * t + 3 * l + 1) % 16} | {(t + 9) % 16})[:2] for l in range(2)]
            for t in range(64)]
    return tmp / "store", [write_trace(tmp / "trace.jsonl", sets, layers=2, top_k=2, n_experts=16)]


def test_limit_is_the_slower_of_compute_and_reads():
    assert scale.limit_tok_s(compute_tok_s=4.0, mb_per_token=500, raw_mb_s=1000) == (2.0, 0.25, 0.5)
    assert scale.limit_tok_s(compute_tok_s=1.0, mb_per_token=100, raw_mb_s=1000)[0] == 1.0


def test_one_round_of_compute_and_a_configuration(shaped):
    store, traces = shaped
    prompt = [5, 6, 7]
    assert scale.compute_bound(store, traces, prompt, tokens=4) > 0
    assert scale.compute_bound(store, traces, prompt, tokens=4, workers=2) > 0
    assert scale.CONFIGS["c2"].args(1)[-4:] == ["--workers", "2", "--scope", "layer"]
    assert scale.CONFIGS["c2"].backend == "mmap" and scale.CONFIGS["s2"].args(1)[-3:] == ["2", "--scope", "global"]
    assert scale.compute_bound(store, traces, prompt, tokens=4, dense="int8") > 0
    assert scale.CONFIGS["c2i"] == scale.replace(scale.CONFIGS["c2"], name=scale.CONFIGS["c2i"].name, dense="int8")
    assert ["--dense", "int8"] == scale.CONFIGS["c2i"].args(1)[-6:-4]
    assert scale.prefill_bound_s(store, traces, prompt * 8) > 0           # one batched step of 24 tokens
    with scale.torch_linears():                                           # the A/B: torch's F.linear throughout
        assert scale.agent.model.model.linear is F.linear and scale.agent.experts.provider.linear is F.linear
        assert scale.compute_bound(store, traces, prompt, tokens=4) > 0
    assert scale.agent.model.model.linear is bf16_matvec.linear
    assert set(scale.slot_dtype_ms(store, repeat=2)) == {"bfloat16", "bfloat16_torch", "float32", "convert_one_block"}
    cgroup = MemoryCgroup(device_memory(store, 4 * 2**20))
    try:
        run = scale.run_config(store, scale.CONFIGS["b"], 0, cgroup, traces, prompt, tokens=4, threads=1)
    finally:
        cgroup.remove()
    assert run.mb_per_token > 0 and 0 <= run.hit_rate <= 1 and len(run.token_ids) == 4
    assert run.peak_rss_bytes > 50 * 2**20                                # a whole python + torch process
    assert set(run.profile_ms) >= {"attention", "router", "route", "wait", "experts", "head", "crc", "policy"}


def test_raw_block_read_reads_every_block_and_refuses_a_short_file(shaped, tmp_path):
    store, _ = shaped
    index = Index.load(store / INDEX)
    assert loader.raw_block_read(store / EXPERTS, index, streams=3) > 0
    short = tmp_path / "short.bin"
    short.write_bytes((store / EXPERTS).read_bytes()[:index.blocks[-1].offset + index.nbytes // 2])
    with pytest.raises(AssertionError, match="ended early"):
        loader.raw_block_read(short, index, streams=3)


def test_summary_takes_medians_and_ratios_within_rounds():
    def run(config, tok_s):
        return {"config": config, "decode_tok_s": tok_s, "limit_tok_s": 2.0, "mb_per_token": 10.0, "hit_rate": 0.5,
                "peak_rss_bytes": 1, "cgroup_peak_bytes": 2, "profile_ms": {"wait": tok_s}, "io_busy": tok_s / 8}
    rounds = [{"raw_mb_s": r, "compute_tok_s": 3.0, "compute_tok_s_torch_linear": 1.0,
               "compute_tok_s_by_workers": {1: 3.0, 2: 2.0 + r},
               "runs": [run("a: x", 1.0 * r), run("c: y", 0.25 * r), run("a2: x, 2 workers", 1.5 * r),
                        run("c2: y, 2 workers", 0.5 * r)]}
              for r in (1, 2, 4)]
    s = scale.summarize(rounds)
    assert s["configs"]["a: x"]["decode_tok_s"] == 2.0 and s["configs"]["a: x"]["of_limit"] == 1.0
    assert s["configs"]["a: x"]["io_busy"] == 0.25
    assert s["tok_s_a_over_c"] == {"median": 4.0, "per_round": [4.0, 4.0, 4.0]} and "tok_s_a_over_b" not in s
    assert s["compute_tok_s_by_workers"] == {1: 3.0, 2: 4.0}
    ratios = ("a2_over_c2", "a2_over_c", "a2_over_a", "c2_over_c")
    assert [s[f"tok_s_{k}"]["median"] for k in ratios] == [3.0, 6.0, 1.5, 2.0]


def test_quant_scale_sets_each_store_against_mmap_of_its_own_and_of_the_bf16_store():
    def run(config, store, tok_s):
        return {"config": scale.CONFIGS[config].name, "store": store, "decode_tok_s": tok_s, "limit_tok_s": 2.0,
                "mb_per_token": 10.0, "hit_rate": 0.5, "peak_rss_bytes": 1}
    rounds = [{"runs": [run("a", "bf16", 2.0 * r), run("a", "int8", 3.0 * r), run("c", "bf16", 1.0 * r),
                        run("c", "int8", 1.5 * r)]} for r in (1, 2)]
    s = quant_scale.summarize(rounds, [scale.CONFIGS["a"], scale.CONFIGS["c"]])
    assert s["configs"][scale.CONFIGS["a"].name]["int8_over_bf16"] == {"median": 1.5, "per_round": [1.5, 1.5]}
    assert {k: r["median"] for k, r in s["a_over_c"].items()} == {"a bf16 / c bf16": 2.0, "a int8 / c int8": 2.0,
                                                                   "a int8 / c bf16": 3.0}
    assert quant_scale.summarize(rounds, [scale.CONFIGS["a"]])["a_over_c"] == {}   # no (c) run: no ratio


def test_sigterm_removes_the_cgroup_of_a_bench_that_made_one(tmp_path):
    """A cgroup outlives a killed process: SIGTERM must remove it, even before the bench's own `try`."""
    script = tmp_path / "bench_stand_in.py"
    script.write_text("import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom bench.memory import MemoryCgroup\n"
                      "cgroup = MemoryCgroup(2**30)\nprint(cgroup.path, flush=True)\ntime.sleep(120)\n"
                      "try:\n    pass\nfinally:\n    cgroup.remove()\n")
    bench = subprocess.Popen([sys.executable, str(script), str(ROOT)], stdout=subprocess.PIPE, text=True)
    path = bench.stdout.readline().strip()
    bench.send_signal(signal.SIGTERM)
    bench.communicate(timeout=60)
    assert bench.returncode != 0
    if path != "None":      # the machine gave it a cgroup
        assert not Path(path).exists(), f"{path} left behind"


def test_a_round_s_raw_rate_is_the_better_of_its_measurements_and_keeps_them_all():
    low = {"raw_mb_s": 1170.0, "raw_file_mb_s": 1170.0, "raw_streams": 1, "raw_blocks_mb_s": 1034.0}
    high = {"raw_mb_s": 1560.0, "raw_file_mb_s": 1560.0, "raw_streams": 8, "raw_blocks_mb_s": 1393.0}
    assert scale.best_raw(low, high) == {**high, "raw_mb_s_measured": [1170.0, 1560.0]}
    assert scale.best_raw(high, low) == {**high, "raw_mb_s_measured": [1560.0, 1170.0]}
