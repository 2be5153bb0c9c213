"""Real-shaped random checkpoints: the published shapes and hub names, written streaming, read by
transformers and by our converter. The 13 GB models are benches; here each shape's config is cut to
a few kilobytes of weights and run through the same code."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from agents import fill
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)

from agent import shapes
from agent.cli import main as cli
from agent.convert import convert
from agent.convert.errors import CheckpointError
from agent.convert.store_writer import StoreWriter
from agent.experts.cache import ExpertCache
from agent.experts.layout import INDEX, Index
from agent.experts.provider import InMemoryExperts
from agent.model.config import MoEConfig
from agent.model.generation import generate
from agent.model.loading import load_model
from agent.model.route_trace import RouteTrace
from agent.shapes import SHAPES, ShapeError, checkpoint_tensors, init_shape, shape_config, write_checkpoint
from agent.traces import TraceError

GB = 1e9


def tiny(name: str) -> dict:
    """Shape `name` with its widths cut: the same architecture switches, a few hundred KB of weights."""
    small = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=16,
                 intermediate_size=32, moe_intermediate_size=32)
    if "head_dim" in SHAPES[name]:
        small |= dict(head_dim=16, num_key_value_heads=2)
    elif "kv_lora_rank" in SHAPES[name]:  # DeepSeek-V2's MLA; transformers reads num_experts as n_routed_experts
        small |= dict(num_key_value_heads=4, n_routed_experts=16, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=12)
    else:
        small |= dict(num_key_value_heads=4)
    if "shared_expert_intermediate_size" in SHAPES[name]:  # Qwen2-MoE's always-on expert
        small |= dict(shared_expert_intermediate_size=48)
    return {**shape_config(name), **small}


def expert_bytes(config: dict) -> float:
    c = MoEConfig.from_hf(config)
    return sum(2 * torch.Size(shape).numel() for name, shape, _ in checkpoint_tensors(c) if ".experts." in name)


def test_the_real_shapes_have_the_published_sizes():
    olmoe = MoEConfig.from_hf(shape_config("olmoe-1b-7b"))
    assert (olmoe.n_layers, olmoe.n_experts, olmoe.top_k, olmoe.dim, olmoe.expert_dim) == (16, 64, 8, 2048, 1024)
    assert expert_bytes(shape_config("olmoe-1b-7b")) / GB == pytest.approx(12.88, abs=0.01)  # 1024 blocks of 12.58 MB
    qwen = MoEConfig.from_hf(shape_config("qwen3-30b-a3b"))
    assert (qwen.n_layers, qwen.n_experts, qwen.top_k, qwen.expert_dim, qwen.head_dim, qwen.qk_norm) == \
        (48, 128, 8, 768, 128, "head")
    assert expert_bytes(shape_config("qwen3-30b-a3b")) / GB == pytest.approx(57.98, abs=0.01)
    assert expert_bytes(shape_config("qwen3-30b-a3b", layers=12)) / GB == pytest.approx(57.98 / 4, abs=0.01)
    qwen15 = MoEConfig.from_hf(shape_config("qwen1.5-moe-a2.7b"))  # what the qwen_* decode traces recorded
    assert (qwen15.n_layers, qwen15.n_experts, qwen15.top_k, qwen15.expert_dim, qwen15.shared_expert_dim) == \
        (24, 60, 4, 1408, 5632)
    assert expert_bytes(shape_config("qwen1.5-moe-a2.7b")) / GB == pytest.approx(24.92, abs=0.01)  # 1440 x 17.3 MB
    lite = MoEConfig.from_hf(shape_config("deepseek-v2-lite"))
    assert (lite.n_layers, lite.moe_layer_ids[0], lite.n_experts, lite.top_k, lite.expert_dim) == (27, 1, 64, 6, 1408)
    assert (lite.mla.q_lora_rank, lite.mla.kv_lora_rank, lite.k_head_dim, lite.mla.v_dim) == (None, 512, 192, 128)
    assert lite.shared_experts_dim == 2816 and lite.yarn.factor == 40
    assert expert_bytes(shape_config("deepseek-v2-lite")) / GB == pytest.approx(28.79, abs=0.01)  # 26 x 64 x 17.3 MB


@pytest.mark.parametrize("name, recorded", [("olmoe-1b-7b", "olmoe"), ("qwen1.5-moe-a2.7b", "qwen")])
def test_each_shape_takes_the_routing_recorded_from_its_model(name, recorded):
    traces = sorted((Path(__file__).parent / "data" / "traces").glob(f"{recorded}_*.jsonl"))
    assert len(traces) == 4
    assert len(RouteTrace.load(traces, MoEConfig.from_hf(shape_config(name))).routes) == 4
    with pytest.raises(TraceError, match="use a trace recorded from this model's architecture"):
        RouteTrace.load(traces, MoEConfig.from_hf(shape_config("qwen3-30b-a3b")))


def test_hub_names_and_shapes():
    names = {n: s for n, s, _ in checkpoint_tensors(MoEConfig.from_hf(shape_config("qwen3-30b-a3b", layers=1)))}
    assert names["model.layers.0.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert names["model.layers.0.self_attn.q_norm.weight"] == (128,)      # Qwen3: per head
    assert names["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)  # 4 kv heads x 128
    assert names["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert names["lm_head.weight"] == (151936, 2048)
    olmoe = {n: s for n, s, _ in checkpoint_tensors(MoEConfig.from_hf(shape_config("olmoe-1b-7b", layers=1)))}
    assert olmoe["model.layers.0.self_attn.q_norm.weight"] == (2048,)      # OLMoE: over the whole projection
    assert olmoe["model.embed_tokens.weight"] == (50304, 2048)


def test_layers_cut_is_stated_and_bounded():
    assert shape_config("qwen3-30b-a3b", layers=12)["flashmoe_cut"] == "12 of 48 layers"
    assert "flashmoe_cut" not in shape_config("olmoe-1b-7b")
    for bad in (0, 49):
        with pytest.raises(ShapeError, match="between 1 and 48"):
            shape_config("qwen3-30b-a3b", layers=bad)
    with pytest.raises(ShapeError, match="olmoe-1b-7b"):
        shape_config("mixtral")


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_written_checkpoint_loads_in_transformers_with_every_tensor(tmp_path, name):
    from transformers import AutoModelForCausalLM
    hf = write_checkpoint(tiny(name), tmp_path / "hf")
    assert len(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(SHAPES))
def test_converted_store_generates_as_the_in_memory_reference(tmp_path, name):
    store = convert(write_checkpoint(tiny(name), tmp_path / "hf"), tmp_path / "store", quantize=None)
    assert store.dtype == "bfloat16" and store.n_experts == 16
    reference = generate(load_model(tmp_path / "store", InMemoryExperts(tmp_path / "store")), [1, 2, 3], 5)
    with ExpertCache(tmp_path / "store", 12 * store.slot_bytes * store.n_layers, policy="lru") as cache:  # 12 of 16
        cached = generate(load_model(tmp_path / "store", cache), [1, 2, 3], 5)
        assert cache.stats().misses > 0
    assert cached.token_ids == reference.token_ids


def test_init_shape_converts_once_and_drops_the_checkpoint_only_when_asked(tmp_path):
    config = tiny("olmoe-1b-7b")
    store = init_shape(config, tmp_path / "m")
    assert (tmp_path / "m" / "hf" / "config.json").exists()
    written = (store / "experts.bin").stat().st_mtime_ns
    assert init_shape(config, tmp_path / "m", drop_hf=True) == store          # already converted: nothing to do
    assert (store / "experts.bin").stat().st_mtime_ns == written and (tmp_path / "m" / "hf").exists()
    init_shape({**config, "num_hidden_layers": 1}, tmp_path / "m", drop_hf=True)  # another config: rebuilt
    assert Index.load(store / INDEX).n_layers == 1 and not (tmp_path / "m" / "hf").exists()


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("theirs", ["notes in hf", "notes in store", "a checkpoint in hf", "a store in store"])
def test_init_shape_replaces_and_drops_only_what_it_wrote(tmp_path, theirs):
    """init-demo --shape --drop-hf replaced OUT/store and deleted OUT/hf whatever they held, a user's files too."""
    config, out = tiny("olmoe-1b-7b"), tmp_path / "m"
    init_shape(config, out)
    if theirs.startswith("notes"):
        (out / theirs.split()[-1] / "notes.txt").write_text("mine")
    else:   # a model of the user's: its config.json is no shape's
        where = out / theirs.split()[-1] / "config.json"
        where.write_text(json.dumps({**json.loads(where.read_text()), "_name_or_path": "allenai/OLMoE-1B-7B-0924"}))
    before = _tree(out)
    with pytest.raises(ShapeError) as err:
        init_shape({**config, "num_hidden_layers": 1}, out, drop_hf=True)
    assert str(out / theirs.split()[-1]) in str(err.value) and "init-demo --shape did not write" in str(err.value)
    assert _tree(out) == before


@pytest.mark.parametrize("out", ["hf", "hf/m"])
def test_init_shape_inside_another_model_is_refused_naming_it(tmp_path, out):
    """OUT/hf and OUT/store were written into a checkpoint that OUT is, or is inside (agent/demo.py's test)."""
    theirs = write_checkpoint(tiny("olmoe-1b-7b"), tmp_path / "hf")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / out / 'hf'} would be written inside the model {theirs} "):
        init_shape(tiny("olmoe-1b-7b"), tmp_path / out)
    assert _tree(tmp_path) == before and sorted(p.name for p in theirs.iterdir() if p.is_dir()) == []


def test_init_shape_onto_a_disk_without_room_fails_at_once_and_writes_nothing(tmpfs):
    disk = tmpfs("1m")
    with pytest.raises(CheckpointError, match=r"the checkpoint with its store needs 1\.\d MB and the disk of "
                                              r".*/disk/m has 1\.0 MB free; free space there or choose another --out"):
        init_shape(tiny("olmoe-1b-7b"), disk / "m")
    assert list(disk.iterdir()) == []


def test_a_disk_that_fills_while_init_shape_writes_the_checkpoint_leaves_nothing(tmpfs, monkeypatch):
    """The start finds room; another writer takes it: the half-written checkpoint is removed, and OUT with it."""
    disk = tmpfs("4m")
    write = shapes.write_safetensors

    def fill_first(*args) -> None:
        fill(disk)
        write(*args)
    monkeypatch.setattr(shapes, "write_safetensors", fill_first)
    with pytest.raises(OSError) as err:
        init_shape(tiny("olmoe-1b-7b"), disk / "m")
    assert err.value.errno == errno.ENOSPC and [p.name for p in disk.iterdir()] == ["filler"]


def test_a_disk_that_fills_while_converting_keeps_the_whole_checkpoint_for_the_rerun(tmpfs, monkeypatch):
    """The checkpoint was deleted with the half-written store, so a rerun wrote its gigabytes again."""
    disk, add_block = tmpfs("4m"), StoreWriter.add_block

    def fill_midway(writer, *args):   # as another writer would, once convert found room
        if len(writer.index.blocks) == writer.n_blocks // 2:
            fill(disk)
        return add_block(writer, *args)
    with monkeypatch.context() as m:
        m.setattr(StoreWriter, "add_block", fill_midway)
        with pytest.raises(OSError) as err:
            init_shape(tiny("olmoe-1b-7b"), disk / "m")
    hf = disk / "m" / "hf"
    assert err.value.errno == errno.ENOSPC and sorted(p.name for p in (disk / "m").iterdir()) == ["hf"]
    written = _tree(hf)
    (disk / "filler").unlink()
    monkeypatch.setattr(shapes, "write_checkpoint", lambda *a: pytest.fail("the whole checkpoint was written again"))
    store = init_shape(tiny("olmoe-1b-7b"), disk / "m")
    assert Index.load(store / INDEX).n_layers == 2 and _tree(hf) == written


def test_a_checkpoint_cut_short_is_written_again(tmp_path):
    """Its index is written last, and removed first by a rewrite: a checkpoint without one is not taken whole."""
    config, hf = tiny("olmoe-1b-7b"), tmp_path / "m" / "hf"
    write_checkpoint(config, hf)
    shard = next(hf.glob("model-*.safetensors"))
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    (hf / "model.safetensors.index.json").unlink()
    init_shape(config, tmp_path / "m")
    assert shard.read_bytes() == whole


def test_cli_refuses_shape_options_without_a_shape(tmp_path, caplog):
    assert cli(["init-demo", "--out", str(tmp_path / "d"), "--layers", "2"]) == 1
    assert "only with --shape" in caplog.text
    assert cli(["init-demo", "--shape", "qwen3-30b-a3b", "--layers", "99", "--out", str(tmp_path / "q")]) == 1
    assert "between 1 and 48" in caplog.text and not (tmp_path / "q").exists()


def test_a_lazy_tensor_of_the_wrong_size_is_refused(tmp_path):
    import numpy as np

    from agent.convert.safetensors_io import Lazy, write_safetensors
    with pytest.raises(ValueError, match="made 6 bytes"):
        write_safetensors(tmp_path / "x.safetensors", [("w", Lazy("BF16", (2, 2), lambda: np.zeros(3, np.uint16)))])
