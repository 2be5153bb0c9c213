"""flashmoe-cli convert: real HF checkpoints (tiny, random weights) in, expert stores out."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from agent.convert import CheckpointError, convert
from agent.experts.layout import ALIGN, CONFIG, DENSE, EXPERTS, INDEX, Index, StoreError
from agent.experts.provider import InMemoryExperts
from agent.model.loading import load_model
from agent.tokenizer import byte_level_tokenizer_json
from hf_models import ARCHS, expert_weights, saved_dense_names, tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "agent.cli"]
# (layout, max_shard_size): both layouts, single file and sharded.
LAYOUT_CASES = [("per_expert", None), ("per_expert", "20KB"), ("fused", None), ("fused", "20KB")]


def _moe_layers(ckpt) -> list[int]:
    """The decoder layers with routed experts; store layer i holds the i-th of them."""
    return [i for i, layer in enumerate(ckpt.model.model.layers) if hasattr(layer.mlp, "experts")]


def _assert_store_matches(store: Path, ckpt) -> Index:
    index = Index.load(store / INDEX)
    experts = InMemoryExperts(store)  # verifies every block's CRC
    for store_layer, layer in enumerate(_moe_layers(ckpt)):
        for e in range(index.n_experts):
            for got, want in zip(experts.get(store_layer, e), expert_weights(ckpt.model, layer, e)):
                assert torch.equal(got, want), (layer, e)
    _assert_dense_matches(store, ckpt)
    assert (store / CONFIG).read_bytes() == (ckpt.path / CONFIG).read_bytes()
    return index


def _assert_dense_matches(store: Path, ckpt) -> dict[str, torch.Tensor]:
    """dense.safetensors holds every non-expert tensor of the checkpoint, unchanged."""
    dense, want = load_file(store / DENSE), saved_dense_names(ckpt.model)
    assert dense.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(dense[name], tensor), name
    return dense


def _assert_nothing_written(dst: Path) -> None:
    assert not dst.exists()
    assert not list(dst.parent.glob(f".{dst.name}.*")), "a partial directory was left behind"


@pytest.mark.parametrize("layout,shard", LAYOUT_CASES)
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_store_holds_the_checkpoints_weights(tmp_path, arch, layout, shard):
    ckpt = tiny_checkpoint(arch, tmp_path / "hf", layout=layout, max_shard_size=shard)
    if shard:
        assert (ckpt.path / "model.safetensors.index.json").exists()
    index = convert(ckpt.path, tmp_path / "store")
    assert _assert_store_matches(tmp_path / "store", ckpt) == index
    cfg = ckpt.model.config
    n_experts = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts
    inter = cfg.intermediate_size if arch in ("olmoe", "mixtral") else cfg.moe_intermediate_size
    assert (index.n_layers, index.n_experts, index.hidden, index.intermediate) == (
        len(_moe_layers(ckpt)), n_experts, cfg.hidden_size, inter)
    assert (index.dtype, index.itemsize, index.alignment) == ("float32", 4, ALIGN)


# (arch, config overrides, the decoder layers with routed experts)
DENSE_LAYER_CASES = [("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0]), [1, 2]),
                     ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2), [1, 3]),
                     ("deepseek_v2", dict(num_hidden_layers=4, first_k_dense_replace=2), [2, 3])]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("arch,overrides,moe_layers", DENSE_LAYER_CASES)
def test_dense_mlp_layers_stay_dense_and_the_model_matches_transformers(tmp_path, layout, arch, overrides,
                                                                       moe_layers):
    """Qwen's mlp_only_layers / decoder_sparse_step, DeepSeek's first_k_dense_replace: store layer i holds
    the experts of the i-th MoE decoder layer; the dense MLPs go to dense.safetensors; the loaded store
    computes transformers' logits."""
    ckpt = tiny_checkpoint(arch, tmp_path / "hf", layout=layout, **overrides)
    hf_layers = ckpt.model.model.layers
    assert _moe_layers(ckpt) == moe_layers
    index = convert(ckpt.path, tmp_path / "store")
    assert index.n_layers == len(moe_layers)
    experts = InMemoryExperts(tmp_path / "store")
    for store_layer, layer in enumerate(moe_layers):
        for e in range(index.n_experts):
            for got, want in zip(experts.get(store_layer, e), expert_weights(ckpt.model, layer, e)):
                assert torch.equal(got, want), (layer, e)
    dense = _assert_dense_matches(tmp_path / "store", ckpt)
    dense_mlp = set(range(len(hf_layers))) - set(moe_layers)
    assert {f"model.layers.{i}.mlp.gate_proj.weight" for i in dense_mlp} <= dense.keys()
    model = load_model(tmp_path / "store", experts)
    ids = [5, 17, 42, 7, 99, 3, 250, 11]
    with torch.no_grad():
        ref = ckpt.model(torch.tensor([ids])).logits[0]
    ours = model.step([(model.new_sequence(len(ids)), torch.tensor(ids))], all_logits=True)[0]
    assert ref.abs().max() > 1.0    # large enough that a wrong model cannot hide under the tolerance
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_expert_tensors_in_a_layer_the_config_makes_dense(tmp_path):
    ckpt = tiny_checkpoint("qwen2_moe", tmp_path / "hf")
    _edit_config(ckpt.path, mlp_only_layers=[0])
    _convert_fails(ckpt.path, tmp_path / "store", "layer(s) [0]", "mlp_only_layers")


def test_blocks_are_aligned_contiguous_and_in_index_order(tmp_path):
    ckpt = tiny_checkpoint("qwen2_moe", tmp_path / "hf")
    index = convert(ckpt.path, tmp_path / "store")
    assert index.slot_bytes % ALIGN == 0 and index.slot_bytes >= index.nbytes
    for i, block in enumerate(index.blocks):
        assert (block.layer, block.expert) == divmod(i, index.n_experts)
        assert block.offset == i * index.slot_bytes
    assert (tmp_path / "store" / EXPERTS).stat().st_size == len(index.blocks) * index.slot_bytes
    raw = (tmp_path / "store" / EXPERTS).read_bytes()
    for block in index.blocks:  # padding between payloads is zero
        assert not any(raw[block.offset + index.nbytes:block.offset + index.slot_bytes])


def test_bfloat16_experts_keep_their_dtype_when_asked(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf", dtype=torch.bfloat16)
    convert(ckpt.path, tmp_path / "store", quantize=None)
    index = _assert_store_matches(tmp_path / "store", ckpt)
    assert (index.dtype, index.itemsize, index.quant) == ("bfloat16", 2, None)


@pytest.mark.parametrize("dtype,widths,quant", [(torch.bfloat16, {"intermediate_size": 32}, "int8"),  # hidden 32
                                                (torch.float32, {"intermediate_size": 32}, None),   # no float32 kernel
                                                (torch.bfloat16, {}, None)])   # intermediate 24: nor for this width
def test_by_default_bf16_experts_the_int8_kernel_takes_are_stored_as_int8(tmp_path, dtype, widths, quant):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf", dtype=dtype, **widths)
    assert convert(ckpt.path, tmp_path / "store").quant == quant


def test_fused_layout_is_one_transformers_loads(tmp_path):
    """Guards the test helper: the fused checkpoints are real ones, not our own invention."""
    ckpt = tiny_checkpoint("mixtral", tmp_path / "hf", layout="fused", max_shard_size="20KB")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 141, 59, 26, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ckpt.model(ids).logits)


def test_tokenizer_json_is_copied(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (ckpt.path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    convert(ckpt.path, tmp_path / "store")
    assert (tmp_path / "store" / "tokenizer.json").read_bytes() == (ckpt.path / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("text", ['{"version":"1.0","model":{"type":"BPE"', '{"version": "1.0"}', "\u00e9t\u00e9"])
def test_a_tokenizer_json_that_does_not_load_is_refused_before_anything_is_written(tmp_path, text):
    """It was copied into the store and convert said it wrote a store; generate then failed on it."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (ckpt.path / "tokenizer.json").write_text(text)
    _convert_fails(ckpt.path, tmp_path / "store", f"{ckpt.path / 'tokenizer.json'} is not a valid tokenizer.json")


# ---------------------------------------------------------------- bad input: clear errors, nothing written

def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / CONFIG).read_text())
    (path / CONFIG).write_text(json.dumps({**config, **changes}))


def _drop_tensor(path: Path, name: str) -> None:
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _convert_fails(src: Path, dst: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as err:
        convert(src, dst)
    for fragment in fragments:
        assert fragment in str(err.value)
    _assert_nothing_written(dst)
    return str(err.value)


def test_missing_shard_is_named(tmp_path):
    ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", max_shard_size="20KB")
    shard = sorted(ckpt.path.glob("model-*.safetensors"))[1]
    shard.unlink()
    _convert_fails(ckpt.path, tmp_path / "store", "missing shard", shard.name)


@pytest.mark.parametrize("weight_map", [[1], {"model.embed_tokens.weight": 5}, None])
def test_a_shard_index_whose_weight_map_is_damaged_is_named(tmp_path, weight_map):
    """A weight_map that is no object of file names was an AttributeError or TypeError traceback."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf", max_shard_size="20KB")
    index = ckpt.path / "model.safetensors.index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": weight_map}))
    _convert_fails(ckpt.path, tmp_path / "store", "model.safetensors.index.json is not a valid shard index",
                   "weight_map must map each tensor name")


@pytest.mark.parametrize("there", [False, True])
@pytest.mark.parametrize("entry", ["../../{name}", "{outside}/{name}"])
def test_a_shard_index_that_names_a_file_outside_the_checkpoint_is_refused_by_entry(tmp_path, entry, there):
    """`../../x.safetensors` was said to be a missing shard `x.safetensors`, or, with a file there, read and
    said to lack its tensors: the entry names a path outside the checkpoint directory, which convert does not read."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "a" / "hf", max_shard_size="20KB")
    index = ckpt.path / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    shard = sorted(ckpt.path.glob("model-*.safetensors"))[1]
    outside = entry.format(name=shard.name, outside=tmp_path)
    document["weight_map"] = {tensor: outside if file == shard.name else file
                              for tensor, file in document["weight_map"].items()}
    index.write_text(json.dumps(document))
    if there:
        shard.rename(tmp_path / shard.name)
    _convert_fails(ckpt.path, tmp_path / "store", f"{index} names {outside!r} as a shard",
                   "outside the checkpoint directory")


def test_truncated_shard_is_named(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    file = ckpt.path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    _convert_fails(ckpt.path, tmp_path / "store", "truncated", "model.safetensors")


def test_file_that_is_not_safetensors_is_named(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (ckpt.path / "model.safetensors").write_bytes(b"<html>rate limited</html>")
    _convert_fails(ckpt.path, tmp_path / "store", "model.safetensors is not a safetensors file")


def test_unsupported_architecture(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    _edit_config(ckpt.path, model_type="llama")
    _convert_fails(ckpt.path, tmp_path / "store", "'llama' is not supported", "mixtral")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("n_experts", [4, 16])
def test_config_with_wrong_expert_count(tmp_path, layout, n_experts):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf", layout=layout)  # 8 experts
    _edit_config(ckpt.path, num_experts=n_experts)
    _convert_fails(ckpt.path, tmp_path / "store", f"{n_experts}", "disagrees")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_config_with_wrong_hidden_size(tmp_path, layout):
    ckpt = tiny_checkpoint("mixtral", tmp_path / "hf", layout=layout)
    _edit_config(ckpt.path, hidden_size=64)
    _convert_fails(ckpt.path, tmp_path / "store", "hidden_size=64", "disagrees")


def test_config_with_wrong_vocab_size(tmp_path):
    ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf")
    _edit_config(ckpt.path, vocab_size=1000)
    _convert_fails(ckpt.path, tmp_path / "store", "model.embed_tokens.weight", "vocab_size=1000", "disagrees")


def test_config_with_fewer_layers_than_the_tensors(tmp_path):
    ckpt = tiny_checkpoint("qwen2_moe", tmp_path / "hf")
    _edit_config(ckpt.path, num_hidden_layers=1, layer_types=["full_attention"])
    _convert_fails(ckpt.path, tmp_path / "store", "num_hidden_layers=1", "layer 1")


# A wrong type anywhere in config.json is one line naming the field, never a traceback.
BAD_CONFIG_FIELDS = [("hidden_size", "32", "a positive integer"), ("hidden_size", True, "a positive integer"),
                     ("num_hidden_layers", 2.5, "an integer from 1 to 65536"),
                     ("num_hidden_layers", 10**9, "an integer from 1"), ("num_experts", 0, "a positive integer"),
                     ("num_attention_heads", 0, "a positive integer"),
                     ("num_experts_per_tok", -1, "a positive integer"),
                     ("rms_norm_eps", "x", "a positive finite number"),
                     ("rms_norm_eps", None, "a positive finite number"),
                     ("rms_norm_eps", float("nan"), "a positive finite number"),
                     ("rope_theta", [1], "a positive finite number"), ("norm_topk_prob", "yes", "true or false"),
                     ("eos_token_id", "x", "a token id"), ("clip_qkv", float("inf"), "a positive finite number"),
                     ("max_position_embeddings", "x", "a positive integer"), ("rope_parameters", 5, "a JSON object")]


@pytest.mark.parametrize("field,value,what", BAD_CONFIG_FIELDS)
def test_config_field_of_the_wrong_type_is_named(tmp_path, field, value, what):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    _edit_config(ckpt.path, **{field: value})
    message = _convert_fails(ckpt.path, tmp_path / "store", f"{field}=", f"it must be {what}")
    assert "\n" not in message


@pytest.mark.parametrize("arch,changes,fragments", [
    ("olmoe", dict(num_experts_per_tok=9), ["num_experts_per_tok=9", "only 8"]),
    ("mixtral", dict(num_experts_per_tok=5), ["num_experts_per_tok=5", "only 4"]),
    ("qwen3_moe", dict(num_key_value_heads=3), ["num_attention_heads=4", "num_key_value_heads=3"]),
    ("qwen2_moe", dict(layer_types=["full_attention"]), ["1 layer_types", "num_hidden_layers=2"]),
])
def test_config_whose_counts_disagree_is_refused(tmp_path, arch, changes, fragments):
    ckpt = tiny_checkpoint(arch, tmp_path / "hf")
    _edit_config(ckpt.path, **changes)
    _convert_fails(ckpt.path, tmp_path / "store", *fragments)


def test_rope_theta_inside_rope_parameters_is_checked(tmp_path):
    ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf")
    _edit_config(ckpt.path, rope_parameters={"rope_type": "default", "rope_theta": "1e6"})
    _convert_fails(ckpt.path, tmp_path / "store", 'rope_theta="1e6"', "positive finite number")


@pytest.mark.parametrize("document,kind", [("[1, 2]", "list"), ('"olmoe"', "string"), ("null", "null"),
                                           ("42", "number")])
def test_config_that_is_not_a_json_object(tmp_path, document, kind):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (ckpt.path / CONFIG).write_text(document)
    _convert_fails(ckpt.path, tmp_path / "store", f"config.json holds a JSON {kind}, not an object")


def test_tensors_whose_bytes_overlap_are_refused(tmp_path):
    """Two expert tensors pointing at the same bytes would convert into two aliased experts."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    file = ckpt.path / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    a, b = "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    _convert_fails(ckpt.path, tmp_path / "store", "share bytes", a, b)


def test_missing_expert_tensor_is_named(tmp_path):
    ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    _drop_tensor(ckpt.path, name)
    _convert_fails(ckpt.path, tmp_path / "store", "missing expert tensor", name)


def test_missing_fused_tensor_is_named(tmp_path):
    ckpt = tiny_checkpoint("qwen2_moe", tmp_path / "hf", layout="fused")
    _drop_tensor(ckpt.path, "model.layers.0.mlp.experts.down_proj")
    _convert_fails(ckpt.path, tmp_path / "store", "model.layers.0.mlp.experts.down_proj")


def test_missing_config(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (ckpt.path / CONFIG).unlink()
    _convert_fails(ckpt.path, tmp_path / "store", "config.json not found")


def test_non_empty_destination_needs_overwrite(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    dst = tmp_path / "store"
    convert(ckpt.path, dst, quantize="int8")
    with pytest.raises(CheckpointError, match="--overwrite"):
        convert(ckpt.path, dst, quantize=None)
    assert Index.load(dst / INDEX).quant == "int8"
    convert(ckpt.path, dst, overwrite=True, quantize=None)
    _assert_store_matches(dst, ckpt)


@pytest.mark.parametrize("inside", [False, True])
def test_overwrite_replaces_an_expert_store_and_nothing_else(tmp_path, inside):
    """--overwrite emptied any directory: a user's notes, or a store they had put notes into, went without a word."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    dst = tmp_path / "store"
    if inside:
        convert(ckpt.path, dst)
    else:
        dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    before = sorted(p.name for p in dst.iterdir())
    with pytest.raises(CheckpointError) as err:
        convert(ckpt.path, dst, overwrite=True)
    assert f"{dst} is not an expert store (it holds notes.txt); --overwrite replaces only" in str(err.value)
    assert sorted(p.name for p in dst.iterdir()) == before and (dst / "notes.txt").read_text() == "mine"


def test_a_destination_that_holds_the_checkpoint_or_is_inside_it_is_refused(tmp_path):
    """`convert par/hf par --overwrite` replaced par, and the checkpoint in it went with it (exit 0)."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "par" / "hf")
    (tmp_path / "par" / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    bad = subprocess.run(CLI + ["convert", str(ckpt.path), str(tmp_path / "par"), "--overwrite"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert f"the destination {tmp_path / 'par'} holds the checkpoint {ckpt.path}" in bad.stderr
    with pytest.raises(CheckpointError, match="is inside the checkpoint"):
        convert(ckpt.path, ckpt.path / "store", overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_destination_inside_another_model_is_refused_naming_it(tmp_path):
    """`convert hf demo/store2` wrote a store inside another store: it went with that model when init-demo
    rebuilt it or convert --overwrite replaced it."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    convert(ckpt.path, tmp_path / "store")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    bad = subprocess.run(CLI + ["convert", str(ckpt.path), str(tmp_path / "store" / "more" / "store2")], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert f"would be written inside the model {tmp_path / 'store'}" in bad.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_an_empty_destination_directory_is_fine(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (tmp_path / "store").mkdir()
    convert(ckpt.path, tmp_path / "store")
    _assert_store_matches(tmp_path / "store", ckpt)


def test_failure_while_writing_leaves_nothing(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")

    def fail_midway(done: int, total: int) -> None:
        if done == total // 2:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        convert(ckpt.path, tmp_path / "store", progress=fail_midway)
    _assert_nothing_written(tmp_path / "store")


# ---------------------------------------------------------------- corruption is caught by CRC on load

def test_bit_flip_names_layer_and_expert(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    index = convert(ckpt.path, tmp_path / "store")
    block = index.block(1, 3)
    with open(tmp_path / "store" / EXPERTS, "r+b") as f:
        f.seek(block.offset + index.nbytes // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(StoreError, match="layer 1 expert 3 "):
        InMemoryExperts(tmp_path / "store")


@pytest.mark.parametrize("where", ["data", "header"])
def test_damaged_dense_weights_are_refused_by_name(tmp_path, where):
    """A flipped bit in the dense weights loaded silently (only the experts' blocks had a checksum), and
    a damaged header gave safetensors' own traceback."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    convert(ckpt.path, tmp_path / "store")
    load_model(tmp_path / "store", InMemoryExperts(tmp_path / "store"))       # whole, it loads
    path = tmp_path / "store" / DENSE
    data = bytearray(path.read_bytes())
    at = len(data) - 100 if where == "data" else 8    # a weight near the end; the header's opening brace
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{DENSE} is damaged: its crc32 differs"):
        load_model(tmp_path / "store", InMemoryExperts(tmp_path / "store"))
    index = json.loads((tmp_path / "store" / INDEX).read_text())
    index["dense_crc32"] = None                       # a store written before the checksum was kept
    (tmp_path / "store" / INDEX).write_text(json.dumps(index))
    if where == "header":
        with pytest.raises(StoreError, match=f"{DENSE} has a corrupt safetensors header .*; re-run flashmoe-cli conv"):
            load_model(tmp_path / "store", InMemoryExperts(tmp_path / "store"))
    else:
        load_model(tmp_path / "store", InMemoryExperts(tmp_path / "store"))   # unchecked, as before


@pytest.mark.parametrize("value", ["abc", 1.5, -1, 1 << 32, True, [1]])
def test_a_dense_checksum_that_is_not_a_crc32_is_refused_by_name(tmp_path, value):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    convert(ckpt.path, tmp_path / "store")
    index = json.loads((tmp_path / "store" / INDEX).read_text())
    (tmp_path / "store" / INDEX).write_text(json.dumps({**index, "dense_crc32": value}))
    with pytest.raises(StoreError, match="dense_crc32 is .*expected a crc32"):
        Index.load(tmp_path / "store" / INDEX)


def test_truncated_expert_file_names_layer_and_expert(tmp_path):
    ckpt = tiny_checkpoint("mixtral", tmp_path / "hf")
    index = convert(ckpt.path, tmp_path / "store")
    last = index.blocks[-1]
    os.truncate(tmp_path / "store" / EXPERTS, last.offset + 100)
    with pytest.raises(StoreError, match=f"layer {last.layer} expert {last.expert} "):
        InMemoryExperts(tmp_path / "store")


# ---------------------------------------------------------------- a store that is not there

@pytest.mark.parametrize("make", [lambda d: None, lambda d: d.mkdir()], ids=["no directory", "no index"])
def test_loading_a_store_that_does_not_exist_says_so_and_what_to_run(tmp_path, make):
    make(tmp_path / "store")
    with pytest.raises(StoreError) as err:
        Index.load(tmp_path / "store" / INDEX)
    message = str(err.value)
    assert "does not exist" in message and "incomplete" not in message
    assert f"flashmoe-cli convert SRC_HF_DIR {tmp_path / 'store'}" in message and "flashmoe-cli init-demo" in message


def test_a_store_whose_index_was_never_written_is_incomplete(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    convert(ckpt.path, tmp_path / "store")
    (tmp_path / "store" / INDEX).unlink()     # as if convert stopped just before its last write
    with pytest.raises(StoreError, match=r"incomplete \(was convert interrupted\?\)"):
        Index.load(tmp_path / "store" / INDEX)


# ---------------------------------------------------------------- streaming and interruption (real processes)

@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """~100 MB of experts: 4 layers x 64 experts of 384 KiB."""
    return tiny_checkpoint("olmoe", tmp_path_factory.mktemp("big") / "hf", hidden_size=128, intermediate_size=256,
                           num_experts=64, num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=4)


_PEAK_SCRIPT = """
import resource, sys
from agent.convert import convert
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert(sys.argv[1], sys.argv[2])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def _peak_growth(src: Path, dst: Path) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(src), str(dst)], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_peak_memory_does_not_grow_with_model_size(tmp_path, big_checkpoint):
    small = tiny_checkpoint("olmoe", tmp_path / "hf", hidden_size=128, intermediate_size=256, num_experts=8,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    small_growth = _peak_growth(small.path, tmp_path / "small")
    big_growth = _peak_growth(big_checkpoint.path, tmp_path / "big")
    big_bytes = (tmp_path / "big" / EXPERTS).stat().st_size
    small_bytes = (tmp_path / "small" / EXPERTS).stat().st_size
    assert big_bytes > 25 * small_bytes
    # 100 MB more experts may cost at most 4 MB more peak RSS, and the whole peak stays under 5% of the store.
    assert big_growth - small_growth < 4 << 20, (small_growth, big_growth)
    assert big_growth < big_bytes / 20, (big_growth, big_bytes)


_KILL_SCRIPT = """
import os, signal, sys
from agent.convert import convert
def kill_midway(done, total):
    if done == total // 2:
        os.kill(os.getpid(), signal.SIGKILL)
convert(sys.argv[1], sys.argv[2], progress=kill_midway)
"""


def test_killed_convert_leaves_no_store_that_loads(tmp_path, big_checkpoint):
    dst = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(big_checkpoint.path), str(dst)], cwd=REPO)
    assert proc.returncode == -9
    partial = list(tmp_path.glob(".store.partial-*"))
    assert len(partial) == 1 and (partial[0] / EXPERTS).stat().st_size > 0, "the kill did not land midway"
    for candidate in (dst, partial[0]):       # dst itself does not exist: its partial sibling does
        with pytest.raises(StoreError, match="incomplete"):
            Index.load(candidate / INDEX)
    with pytest.raises(StoreError):
        InMemoryExperts(dst)
    convert(big_checkpoint.path, dst)  # a rerun clears the leftover and succeeds
    assert not list(tmp_path.glob(".store.partial-*"))
    assert len(Index.load(dst / INDEX).blocks) == 4 * 64


_SIGNAL_SCRIPT = """
import os, sys
import agent.convert
from agent.cli import main
def signal_midway(done, total):
    if done == total // 2:
        os.kill(os.getpid(), int(sys.argv[3]))
agent.convert._log_progress = signal_midway
sys.exit(main(["convert", sys.argv[1], sys.argv[2]]))
"""


@pytest.mark.parametrize("sig, said", [(signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP: its terminal closed")])
def test_a_convert_stopped_by_sigterm_or_its_terminal_closing_leaves_nothing(tmp_path, big_checkpoint, sig, said):
    """Their default action ended convert on the spot, as SIGKILL does: its partial directory (gigabytes for a
    real model, hidden beside the destination) stayed until a rerun into the same place. Ctrl-C removed it."""
    dst = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT, str(big_checkpoint.path), str(dst), str(int(sig))],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 128 + sig, proc.stderr
    assert f"convert interrupted ({said}) before it finished; run it again" in proc.stderr.splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


_FILL_SCRIPT = """
import sys
from pathlib import Path
import agent.convert
from agent.cli import main
from agents import fill
def fill_midway(done, total):  # as another writer on the disk would, once the start has found room
    if done == total // 2:
        fill(Path(sys.argv[2]).parent)
agent.convert._log_progress = fill_midway
sys.exit(main(["convert", *sys.argv[1:]]))
"""


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_convert_onto_a_disk_without_room_fails_at_once_and_writes_nothing(tmp_path, big_checkpoint, tmpfs):
    disk = tmpfs("20m")
    proc = subprocess.run(CLI + ["convert", str(big_checkpoint.path), str(disk / "store")], cwd=REPO,
                          capture_output=True, text=True)
    line = _one_error_line(proc)
    assert "the store needs 102.2 MB and the disk of" in line
    assert "MB free; free space there or choose another DST_DIR" in line
    assert "converted" not in proc.stderr and list(disk.iterdir()) == []   # refused before the first block


def test_a_disk_that_fills_midway_ends_convert_in_one_line_and_leaves_no_store(tmp_path, big_checkpoint, tmpfs):
    """The start finds room; another writer takes it midway: a real ENOSPC from the kernel, not a mock."""
    disk = tmpfs("200m")
    dst = disk / "store"
    proc = subprocess.run([sys.executable, "-c", _FILL_SCRIPT, str(big_checkpoint.path), str(dst)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    line = _one_error_line(proc)
    assert (f"the disk of {dst} filled up while writing (No space left on device); nothing was written to {dst}: "
            f"free space there or choose another DST_DIR") in line
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]     # no store, no partial directory
    (disk / "filler").unlink()
    refused = subprocess.run(CLI + ["generate", "--model", str(dst), "--prompt", "hi"], cwd=REPO,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "is not a directory" in refused.stderr and "Traceback" not in refused.stderr
    again = subprocess.run(CLI + ["convert", str(big_checkpoint.path), str(dst)], cwd=REPO, capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr
    assert len(Index.load(dst / INDEX).blocks) == 4 * 64


@pytest.mark.parametrize("inodes", [3, 4])   # room for OUT's two parents; and for the temporary directory too
def test_a_disk_out_of_inodes_ends_convert_in_one_line_and_leaves_nothing(tmp_path, tmpfs, inodes):
    """The directories convert made before it failed to make its temporary directory (or its first file) were
    left, under a message that said nothing was written."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    disk = tmpfs("4m", inodes)
    proc = subprocess.run(CLI + ["convert", str(ckpt.path), str(disk / "a" / "b" / "store")], cwd=REPO,
                          capture_output=True, text=True)
    assert "filled up while writing (No space left on device); nothing was written" in _one_error_line(proc)
    assert list(disk.iterdir()) == []


_KILL_IN_REMOVAL_SCRIPT = """
import os, shutil, signal, sys
from agent.cli import main
real_rmtree = shutil.rmtree
def kill_in_removal(path, *args, **kwargs):  # the old store is half removed when the kill lands
    if ".old-" in str(path):
        os.remove(os.path.join(path, "store", "experts.bin"))
        os.kill(os.getpid(), signal.SIGKILL)
    real_rmtree(path, *args, **kwargs)
shutil.rmtree = kill_in_removal
sys.exit(main(["convert", "--overwrite", *sys.argv[1:]]))
"""


def test_a_convert_killed_while_removing_the_store_it_replaced_leaves_nothing_the_next_run_keeps(tmp_path):
    """The replaced store's directory (.store.old-*) was left, whole or in part, where no one would find it."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    dst = tmp_path / "store"
    convert(ckpt.path, dst)
    proc = subprocess.run([sys.executable, "-c", _KILL_IN_REMOVAL_SCRIPT, str(ckpt.path), str(dst)], cwd=REPO)
    assert proc.returncode == -9
    assert len(list(tmp_path.glob(".store.old-*"))) == 1 and len(Index.load(dst / INDEX).blocks) > 0  # the new one
    again = subprocess.run(CLI + ["convert", "--overwrite", str(ckpt.path), str(dst)], cwd=REPO,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "the store an interrupted --overwrite replaced" in again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "store"]


# ---------------------------------------------------------------- the command line

def test_cli_converts_and_reports_bad_input(tmp_path):
    ckpt = tiny_checkpoint("qwen2_moe", tmp_path / "hf", layout="fused")
    ok = subprocess.run(CLI + ["convert", str(ckpt.path), str(tmp_path / "store")], cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    _assert_store_matches(tmp_path / "store", ckpt)
    _edit_config(ckpt.path, model_type="gpt2")
    bad = subprocess.run(CLI + ["convert", str(ckpt.path), str(tmp_path / "other")], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "model_type 'gpt2' is not supported" in bad.stderr
    _assert_nothing_written(tmp_path / "other")


@pytest.mark.parametrize("changes", [dict(hidden_size="32"), dict(num_experts_per_tok=9)])
def test_cli_reports_a_bad_config_in_one_line(tmp_path, changes):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    _edit_config(ckpt.path, **changes)
    bad = subprocess.run(CLI + ["convert", str(ckpt.path), str(tmp_path / "store")], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert f"{next(iter(changes))}=" in bad.stderr
    _assert_nothing_written(tmp_path / "store")


def test_cli_help_has_an_example():
    out = subprocess.run(CLI + ["convert", "--help"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "example:" in out.stdout and "flashmoe-cli convert " in out.stdout


def test_a_directory_without_config_json_names_src_dir_not_model(tmp_path):
    (tmp_path / "hf").mkdir()
    message = _convert_fails(tmp_path / "hf", tmp_path / "store", f"{tmp_path / 'hf' / CONFIG} not found", "SRC_DIR")
    assert "--model" not in message


@pytest.mark.parametrize("target", ["empty directory", "dangling", "store"])
def test_a_destination_that_is_a_symlink_is_written_where_it_points(tmp_path, target):
    """`ln -s /mnt/nvme/olmoe data/olmoe; convert hf data/olmoe` (a store on the SSD through a link) wrote every
    block beside the link, on the link's disk, then failed: "[Errno 20] Not a directory" renaming it onto the link."""
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    ssd, link = tmp_path / "ssd" / "olmoe", tmp_path / "data" / "olmoe"
    if target == "empty directory":
        ssd.mkdir(parents=True)
    elif target == "store":
        convert(ckpt.path, ssd)
    link.parent.mkdir()
    link.symlink_to(ssd)
    done = subprocess.run(CLI + ["convert", str(ckpt.path), str(link), "--overwrite"], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.listdir(link.parent) == ["olmoe"], os.listdir(link.parent)
    _assert_store_matches(ssd, ckpt)
    assert os.listdir(ssd.parent) == ["olmoe"]     # nothing left beside it either


def test_a_destination_that_is_a_symlink_loop_is_one_line(tmp_path):
    ckpt = tiny_checkpoint("olmoe", tmp_path / "hf")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for dst in (tmp_path / "a", tmp_path / "a" / "store"):
        bad = subprocess.run(CLI + ["convert", str(ckpt.path), str(dst)], cwd=REPO, capture_output=True, text=True)
        assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert "is a symlink loop" in bad.stderr and "Traceback" not in bad.stderr
