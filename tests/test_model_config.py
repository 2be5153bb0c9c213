"""MoEConfig from the config.json transformers writes, and its errors for what we cannot run."""
from __future__ import annotations

import json

import pytest

from agent.model.config import SUPPORTED, ConfigError, MoEConfig
from hf_models import ARCHS, tiny_config


def hf_json(arch: str, **overrides) -> dict:
    """The config.json save_pretrained writes for a tiny config of `arch`."""
    return json.loads(tiny_config(arch, **overrides).to_json_string())


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "deepseek_v2"])  # MLA: its own test below
def test_shapes_follow_the_checkpoint(arch):
    hf = hf_json(arch)
    c = MoEConfig.from_hf(hf)
    assert (c.arch, c.dim, c.n_layers, c.n_heads, c.n_kv_heads) == (arch, 32, 2, 4, 2)
    assert c.n_experts == hf.get("num_experts", hf.get("num_local_experts"))
    assert c.expert_dim == hf["moe_intermediate_size" if arch.startswith("qwen") else "intermediate_size"]
    assert c.head_dim == (hf.get("head_dim") or 32 // 4)
    assert c.rms_eps == hf["rms_norm_eps"] and c.rope_theta == hf["rope_parameters"]["rope_theta"]
    assert c.moe_layer_ids == [0, 1]


def test_architecture_switches():
    olmoe, qwen3, qwen2, mixtral = (MoEConfig.from_hf(hf_json(a))
                                    for a in ("olmoe", "qwen3_moe", "qwen2_moe", "mixtral"))
    assert (olmoe.qk_norm, qwen3.qk_norm, qwen2.qk_norm, mixtral.qk_norm) == ("full", "head", None, None)
    assert qwen2.qkv_bias and not qwen2.o_bias and not olmoe.qkv_bias
    assert qwen2.shared_expert_dim == 40 and olmoe.shared_expert_dim == qwen3.shared_expert_dim == 0
    # Mixtral always renormalises the top-k weights; the others follow norm_topk_prob.
    assert mixtral.norm_topk_prob and qwen3.norm_topk_prob and not olmoe.norm_topk_prob


def test_router_and_bias_flags_are_read():
    assert MoEConfig.from_hf(hf_json("olmoe", norm_topk_prob=True, attention_bias=True, clip_qkv=4.0)).clip_qkv == 4.0
    c = MoEConfig.from_hf(hf_json("olmoe", attention_bias=True))
    assert c.qkv_bias and c.o_bias
    assert MoEConfig.from_hf(hf_json("olmoe", tie_word_embeddings=True)).tie_embeddings


def test_sliding_windows_per_layer():
    assert MoEConfig.from_hf(hf_json("mixtral", sliding_window=7)).sliding_window == (7, 7)
    unused = MoEConfig.from_hf(hf_json("qwen3_moe", use_sliding_window=False, sliding_window=7))
    assert unused.sliding_window == (None, None)
    assert MoEConfig.from_hf(hf_json("qwen3_moe", use_sliding_window=True, sliding_window=7)).sliding_window == (7, 7)
    # Qwen2-MoE: even-numbered layers below max_window_layers slide, as transformers' layer_types says.
    qwen2 = MoEConfig.from_hf(hf_json("qwen2_moe", use_sliding_window=True, sliding_window=7, max_window_layers=1))
    assert qwen2.sliding_window == (7, None)


def test_dense_mlp_layers_are_not_moe_layers():
    c = MoEConfig.from_hf(hf_json("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1))
    assert c.moe_layers == (False, True, True, True) and c.moe_layer_ids == [1, 2, 3] and c.dense_dim == 48
    c = MoEConfig.from_hf(hf_json("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2))
    assert c.moe_layer_ids == [1, 3]


def test_deepseek_v2_shapes_and_switches():
    c = MoEConfig.from_hf(hf_json("deepseek_v2", q_lora_rank=8))
    assert (c.n_heads, c.n_kv_heads, c.n_experts, c.top_k, c.expert_dim) == (4, 4, 8, 2, 16)
    assert (c.head_dim, c.k_head_dim, c.mla.v_dim) == (4, 10, 8)  # rotary part, nope + rope, value
    assert c.kv_cache_shape == (1, 12, 4)  # one latent and one rotary key per token
    assert (c.mla.q_lora_rank, c.mla.kv_lora_rank, c.mla.nope_dim) == (8, 12, 6)
    assert c.moe_layers == (False, True, True) and c.dense_dim == 48
    assert c.shared_experts_dim == 2 * 16 and c.shared_expert_dim == 0
    assert c.routed_scale == 1.5 and not c.norm_topk_prob
    assert MoEConfig.from_hf({**hf_json("deepseek_v2"), "n_shared_experts": 0}).shared_experts_dim == 0


@pytest.mark.parametrize("change", [
    dict(topk_method="noaux_tc"),
    dict(scoring_func="sigmoid"), dict(norm_topk_prob=True), dict(moe_layer_freq=2), dict(mlp_bias=True),
    dict(qk_rope_head_dim=5),
])
def test_deepseek_v2_variants_we_do_not_run_are_named(change):
    field = next(iter(change))
    with pytest.raises(ConfigError, match=rf"deepseek_v2 config.json has {field}=.*supported: topk_method greedy"):
        MoEConfig.from_hf({**hf_json("deepseek_v2"), **change})


def test_deepseek_v2_expert_groups():
    c = MoEConfig.from_hf(hf_json("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2))
    assert c.expert_groups == (4, 2)
    assert MoEConfig.from_hf(hf_json("deepseek_v2", n_group=4, topk_group=2)).expert_groups is None  # greedy
    for groups in (dict(n_group=3, topk_group=1), dict(n_group=4, topk_group=5), dict(n_group=None, topk_group=1)):
        with pytest.raises(ConfigError, match="n_group must divide n_routed_experts=8"):
            MoEConfig.from_hf({**hf_json("deepseek_v2"), "topk_method": "group_limited_greedy", **groups})


def test_deepseek_v2_needs_its_expert_count():
    hf = hf_json("deepseek_v2")
    del hf["n_routed_experts"]
    with pytest.raises(ConfigError, match="missing n_routed_experts"):
        MoEConfig.from_hf(hf)


def test_legacy_rope_theta_and_eos_list():
    hf = hf_json("mixtral")
    del hf["rope_parameters"]
    hf.update(rope_theta=5e5, rope_scaling=None, eos_token_id=[7, 8])
    c = MoEConfig.from_hf(hf)
    assert c.rope_theta == 5e5 and c.eos_token_id == 7


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ConfigError) as err:
        MoEConfig.from_hf({"model_type": "deepseek_v3", "hidden_size": 8})
    assert "deepseek_v3" in str(err.value) and all(a in str(err.value) for a in SUPPORTED)


def test_missing_fields_are_named():
    hf = hf_json("qwen2_moe")
    del hf["shared_expert_intermediate_size"], hf["num_experts"]
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size.*num_experts"):
        MoEConfig.from_hf(hf)


@pytest.mark.parametrize("change, words", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'yarn'"),
])
def test_unsupported_variants(change, words):
    with pytest.raises(ConfigError, match=words):
        MoEConfig.from_hf({**hf_json("olmoe"), **change})


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        MoEConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MoEConfig.from_file(tmp_path / "config.json")
