"""bench/scale_prompts.py on a small DeepSeek-V2 shape and a prefill NPZ made here: a prompt's slice, the
placement that routes its token p by its recorded row p, and the agent's hit rate against the simulator's
on the rows it ran (the 9 GB runs are benches, not tests)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_shapes import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent.convert import convert  # noqa: E402
from agent.generate import run_generate  # noqa: E402
from agent.model.config import MoEConfig  # noqa: E402
from agent.shapes import shape_config, write_checkpoint  # noqa: E402
from agent.traces import read_jsonl, read_npz  # noqa: E402
from bench import scale_prompts  # noqa: E402

EXPERTS, TOP_K, LAYERS = 16, 6, 3      # the NPZ routes one layer more than the store has


@pytest.fixture(scope="module")
def lite(tmp_path_factory) -> tuple[Path, Path]:
    """DeepSeek-V2-Lite's shape cut small (3 layers, the first dense: 2 MoE layers x 16 experts, top-6), and
    a prefill NPZ of 3 prompts x 3 layers whose rows differ from token to token."""
    tmp = tmp_path_factory.mktemp("prompts")
    store = tmp / "store"
    convert(write_checkpoint({**tiny("deepseek-v2-lite"), "num_hidden_layers": 3}, tmp / "hf"), store, quantize=None)
    rng = np.random.default_rng(0)
    lengths = [5, 30, 7]
    ids = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)])
                    for _ in range(sum(lengths))]).astype(np.uint8)
    npz = tmp / "prefill.npz"
    np.savez(npz, expert_ids=ids, prompt_offsets=np.cumsum([0, *lengths]),
             prompt_numbers=np.array([11, 12, 13], np.int32),
             layers=np.arange(1, LAYERS + 1, dtype=np.int16), meta=json.dumps({"model": "test", "n_experts": EXPERTS}))
    return store, npz


def test_a_slice_holds_one_prompt_cut_to_the_model(lite, tmp_path):
    _, npz = lite
    whole = np.load(npz)["expert_ids"]
    one = np.load(scale_prompts.prompt_slice(npz, 12, 2, tmp_path))
    assert one["expert_ids"].shape == (30, 2, TOP_K) and (one["expert_ids"] == whole[5:35, :2]).all()
    assert list(one["prompt_offsets"]) == [0, 30] and list(one["prompt_numbers"]) == [12]
    assert read_npz(scale_prompts.prompt_slice(npz, 12, 2, tmp_path, rows=4)).n_tokens == 4
    with pytest.raises(SystemExit, match="no prompt numbered 14"):
        scale_prompts.prompt_slice(npz, 14, 2, tmp_path)
    with pytest.raises(SystemExit, match="routes 3 layers, the model has 4"):
        scale_prompts.prompt_slice(npz, 12, 4, tmp_path)


def test_every_token_takes_its_recorded_row_and_the_simulator_agrees(lite, tmp_path):
    store, npz = lite
    config = MoEConfig.from_file(store / "config.json")
    trace = scale_prompts.prompt_slice(npz, 12, 2, tmp_path)
    ids = scale_prompts.placed_at_start(trace, config, 26)
    result = run_generate(store, prompt_ids=ids, max_new_tokens=4, greedy=True, cache_cap="50%", policy="lru",
                          prefetch="off", route_trace=[trace], record_trace=tmp_path / "ran.jsonl")
    ran = read_jsonl(tmp_path / "ran.jsonl")
    rows = np.load(trace)["expert_ids"]
    assert ran.n_tokens == 29                                           # 26 prompt tokens and 3 decode steps
    for token in range(ran.n_tokens):
        for layer in range(2):
            row = ran.experts[ran.offsets[token * 2 + layer]:ran.offsets[token * 2 + layer + 1]]
            assert sorted(row) == sorted(rows[token, layer])
    slots = result.stats["capacity_slots"]
    ran_rows = scale_prompts.prompt_slice(trace, 12, 2, tmp_path, rows=29, id_order=True)
    sim = scale_prompts.simulated_hit_rates(ran_rows, slots)
    assert sim["lru"] == pytest.approx(result.stats["hit_rate"])          # LRU without prefetch: the same hits


def test_mla_caches_a_latent_nine_times_smaller_than_the_heads_it_makes():
    lite = MoEConfig.from_hf(shape_config("deepseek-v2-lite"))
    assert scale_prompts.kv_bytes(lite) == {"cached": (512 + 64) * 2, "expanded": 16 * (192 + 128) * 2}   # 8.9x


def test_decode_at_contexts_times_attention_over_a_filled_kv_cache(lite):
    store, _ = lite
    at = scale_prompts.decode_at_contexts(store, [4, 64], repeat=1)
    assert set(at) == {4, 64}
    assert all(0 < a["attention_ms"] < a["step_ms"] for a in at.values())
    assert at[64]["kv_bytes_per_position"] == 3 * (16 + 8) * 2          # 3 layers x (latent 16 + rotary key 8), bf16
