"""Our decoder against transformers: tiny random checkpoints, converted to an expert store, loaded from disk.

Each checkpoint is built with transformers (`from_config`, seeded, fp32), saved, converted with
`flashmoe-cli convert`, and loaded by `load_model` with experts read from experts.bin.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import ARCHS, tiny_checkpoint
from safetensors.torch import load_file, save_file

from agent.cli import main as cli
from agent.experts.layout import CONFIG, DENSE, INDEX, StoreError, file_crc32
from agent.experts.provider import InMemoryExperts
from agent.model.config import ConfigError, MoEConfig
from agent.model.generation import generate
from agent.model.loading import load_model
from agent.model.model import Transformer
from agent.model.rope import inv_freq
from agent.shapes import shape_config

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120, 33]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a CPU shared with other jobs every
    parallel kernel can stall for a scheduler slice; one thread keeps these tests fast. Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def converted(tmp: Path, arch: str, layout: str = "per_expert", **overrides):
    """(transformers model, expert store dir) for a tiny checkpoint of `arch`."""
    ckpt = tiny_checkpoint(arch, tmp / "hf", layout=layout, **overrides)
    assert cli(["convert", str(ckpt.path), str(tmp / "store")]) == 0
    return ckpt.model, tmp / "store"


def load(store: Path, prefetch: bool = True) -> Transformer:
    return load_model(store, InMemoryExperts(store), prefetch=prefetch)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def our_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    seq = model.new_sequence(len(ids))
    return model.step([(seq, torch.tensor(ids))], all_logits=True)[0]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # never stop early: compare all n tokens
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert len(out) == n
    return out.tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_and_16_greedy_tokens_match_transformers(tmp_path, arch):
    hf, store = converted(tmp_path, arch)
    model = load(store)
    ref = hf_logits(hf, PROMPT)
    assert ref.abs().max() > 1.0  # logits large enough that a wrong model cannot hide under the tolerance
    torch.testing.assert_close(our_logits(model, PROMPT), ref, atol=1e-4, rtol=0)
    expected = hf_greedy(hf, PROMPT, 16)
    assert generate(model, PROMPT, 16, greedy=True).token_ids == expected
    assert generate(model, PROMPT, 16, greedy=True, prefill_chunk=1).token_ids == expected


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v2"])
def test_fused_checkpoint_layout(tmp_path, arch):
    hf, store = converted(tmp_path, arch, layout="fused")
    torch.testing.assert_close(our_logits(load(store), PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, overrides", [
    ("mixtral", dict(sliding_window=4)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
])
def test_sliding_window(tmp_path, arch, overrides):
    hf, store = converted(tmp_path, arch, **overrides)
    ref = hf_logits(hf, PROMPT)
    full = hf_logits(tiny_checkpoint(arch, tmp_path / "full", **{**overrides, "use_sliding_window": False,
                                                                  "sliding_window": None}).model, PROMPT)
    assert not torch.allclose(ref, full, atol=1e-3)  # the window changes the output, so parity tests it
    torch.testing.assert_close(our_logits(load(store), PROMPT), ref, atol=1e-4, rtol=0)
    assert generate(load(store), PROMPT, 8, greedy=True).token_ids == hf_greedy(hf, PROMPT, 8)


@pytest.mark.parametrize("overrides", [dict(tie_word_embeddings=True), dict(clip_qkv=0.5, attention_bias=True)])
def test_olmoe_variants(tmp_path, overrides):
    hf, store = converted(tmp_path, "olmoe", **overrides)
    torch.testing.assert_close(our_logits(load(store), PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_deepseek_v2_with_a_q_bottleneck_and_expert_groups(tmp_path):
    """DeepSeek-V2 (not Lite) projects q through q_lora_rank and an RMSNorm, and routes each token among
    the experts of its best groups (group_limited_greedy)."""
    groups = dict(topk_method="group_limited_greedy", n_group=4, topk_group=1)
    hf, store = converted(tmp_path, "deepseek_v2", q_lora_rank=8, **groups)
    assert hf.model.layers[0].self_attn.q_a_proj is not None
    free = tiny_checkpoint("deepseek_v2", tmp_path / "greedy", q_lora_rank=8).model
    assert not torch.allclose(hf_logits(hf, PROMPT), hf_logits(free, PROMPT), atol=1e-3)  # the groups matter
    torch.testing.assert_close(our_logits(load(store), PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
    assert generate(load(store), PROMPT, 8, greedy=True).token_ids == hf_greedy(hf, PROMPT, 8)


# DeepSeek-V2-Lite's rope_scaling, with mscale != mscale_all_dim so both the cos/sin and the softmax
# scale differ from 1; a rotary part of 8 puts the blend between original and interpolated frequencies
# in the middle of the dimensions.
LITE_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707)


def test_deepseek_v2_with_yarn_rope(tmp_path):
    hf, store = converted(tmp_path, "deepseek_v2", qk_rope_head_dim=8, rope_parameters=LITE_YARN)
    ref = hf_logits(hf, PROMPT)
    plain = tiny_checkpoint("deepseek_v2", tmp_path / "plain", qk_rope_head_dim=8).model
    assert not torch.allclose(ref, hf_logits(plain, PROMPT), atol=1e-3)  # yarn changes the output
    torch.testing.assert_close(our_logits(load(store), PROMPT), ref, atol=1e-4, rtol=0)
    assert generate(load(store), PROMPT, 8, greedy=True).token_ids == hf_greedy(hf, PROMPT, 8)


def test_deepseek_v2_lite_rope_scaling_is_read_as_transformers_reads_it():
    """Lite's config.json has the legacy rope_scaling form; its frequencies, cos/sin and softmax scale."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding

    lite = shape_config("deepseek-v2-lite")
    ours = MoEConfig.from_hf(lite)
    hf_config = DeepseekV2Config(**{k: v for k, v in lite.items() if k != "model_type"})
    rotary = DeepseekV2RotaryEmbedding(hf_config)
    torch.testing.assert_close(inv_freq(ours.head_dim, ours.rope_theta, ours.yarn), rotary.inv_freq, atol=0, rtol=1e-6)
    assert ours.yarn.attention_factor == pytest.approx(rotary.attention_scaling) and ours.yarn.attention_factor == 1.0
    with torch.device("meta"):
        scaling = DeepseekV2Attention(hf_config, 0).scaling
    assert ours.k_head_dim ** -0.5 * ours.yarn.softmax_scale == pytest.approx(scaling) and scaling > 192 ** -0.5


class Recording:
    """Passes through to a real provider and logs every call in order."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def route(self, layer, experts):
        self.calls.append(("route", layer, list(experts)))

    def get(self, layer, expert):
        self.calls.append(("get", layer, expert))
        return self.inner.get(layer, expert)

    def done(self, layer, expert):
        self.inner.done(layer, expert)

    def prefetch(self, layer, experts):
        self.calls.append(("prefetch", layer, list(experts)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])  # GQA; MLA's latent cache
def test_batched_step_equals_sequences_run_alone(tmp_path, arch):
    _, store = converted(tmp_path, arch)
    model = load(store, prefetch=False)
    a_ids, b_ids, c_ids = PROMPT[:5], PROMPT[3:10], PROMPT[7:]

    def alone(ids: list[int], extra: int) -> list[torch.Tensor]:
        seq = model.new_sequence(16)
        return [model.step([(seq, torch.tensor(ids))])[0], model.step([(seq, torch.tensor([extra]))])[0]]

    a, b, c = model.new_sequence(16), model.new_sequence(16), model.new_sequence(16)
    model.experts.provider = rec = Recording(model.experts.provider)
    first = model.step([(a, torch.tensor(a_ids)), (b, torch.tensor(b_ids))])      # two prefills
    first_calls = list(rec.calls)
    second = model.step([(a, torch.tensor([1])), (c, torch.tensor(c_ids))])       # a decode beside a prefill
    third = model.step([(b, torch.tensor([2]))])
    model.experts.provider = rec.inner
    ref_a, ref_b, ref_c = alone(a_ids, 1), alone(b_ids, 2), alone(c_ids, 0)
    for got, want in [(first[0], ref_a[0]), (first[1], ref_b[0]), (second[0], ref_a[1]), (second[1], ref_c[0]),
                      (third[0], ref_b[1])]:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # One route per MoE layer for the whole batch, each expert fetched once per step.
    routes = [(layer, experts) for kind, layer, experts in first_calls if kind == "route"]
    gets = [(layer, e) for kind, layer, e in first_calls if kind == "get"]
    assert [layer for layer, _ in routes] == [0, 1]
    assert sorted(gets) == [(layer, e) for layer, experts in routes for e in experts]


def test_lookahead_prefetches_the_next_layer_and_counts_accuracy(tmp_path):
    _, store = converted(tmp_path, "olmoe", num_hidden_layers=3)
    model = load(store, prefetch=True)
    model.experts.provider = rec = Recording(model.experts.provider)
    generate(model, PROMPT, 6, greedy=True)
    predicted = correct = 0
    pending: dict[int, set[int]] = {}
    for i, (kind, layer, experts) in enumerate(rec.calls):
        if kind == "route":
            correct += len(pending.pop(layer, set()) & set(experts))
            if layer < 2:  # the call right after routing layer L prefetches layer L+1
                assert rec.calls[i + 1][:2] == ("prefetch", layer + 1)
        elif kind == "prefetch":
            pending[layer] = set(experts)
            predicted += len(experts)
            assert layer > 0
    assert (model.lookahead.predicted, model.lookahead.correct) == (predicted, correct) and predicted > 0
    assert model.lookahead.accuracy == correct / predicted

    quiet = load(store, prefetch=False)
    quiet.experts.provider = rec = Recording(quiet.experts.provider)
    generate(quiet, PROMPT, 6, greedy=True)
    assert not [c for c in rec.calls if c[0] == "prefetch"] and quiet.lookahead.accuracy is None


def test_store_that_disagrees_with_config_is_refused(tmp_path):
    _, store = converted(tmp_path, "mixtral")
    config = json.loads((store / CONFIG).read_text())
    (store / CONFIG).write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(ConfigError, match="experts.index.json has"):
        load(store)
    (store / CONFIG).write_text(json.dumps(config))
    dense = load_file(str(store / DENSE))
    del dense["model.layers.1.self_attn.k_proj.weight"]
    save_file(dense, str(store / DENSE))
    index = json.loads((store / INDEX).read_text())   # written whole, as a converter of another config would
    (store / INDEX).write_text(json.dumps({**index, "dense_crc32": file_crc32(store / DENSE)}))
    with pytest.raises(StoreError, match=r"missing \['layers.1.self_attn.k_proj.weight'\]"):
        load(store)


def test_sequence_overflow_is_refused_before_any_work(tmp_path):
    _, store = converted(tmp_path, "olmoe")
    model = load(store)
    seq = model.new_sequence(4)
    with pytest.raises(ValueError, match="KV cache holds 4"):
        model.step([(seq, torch.tensor(PROMPT))])
    assert seq.pos == 0
