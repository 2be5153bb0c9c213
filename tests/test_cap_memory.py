"""The 70% memory rule counts what the model keeps in RAM besides the expert slots: its dense
weights and a KV cache budget, so slots + dense + KV stay within the share of memory."""
from __future__ import annotations

import json

import pytest
from test_serve import demo_model

from agent.experts import cap
from agent.experts.cache import ExpertCache
from agent.experts.layout import CONFIG, DENSE, INDEX, Index


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return demo_model(tmp_path_factory)


def test_resident_bytes_are_the_dense_file_and_the_kv_budget(model):
    index, config = Index.load(model / INDEX), json.loads((model / CONFIG).read_text())
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * \
        (config["hidden_size"] // config["num_attention_heads"]) * 4             # float32
    assert cap.resident_bytes(model, index) == (model / DENSE).stat().st_size + cap.KV_BUDGET_TOKENS * kv_per_token
    assert cap.resident_bytes(model, index, 100) == (model / DENSE).stat().st_size + 100 * kv_per_token  # --kv-budget


def test_a_cap_that_fits_only_without_the_model_is_refused(model, monkeypatch):
    index = Index.load(model / INDEX)
    reserved = cap.resident_bytes(model, index)
    want = 8 * index.n_layers * index.slot_bytes                                 # 8 experts per layer
    memory = int((want + reserved // 2) / cap.MAX_MEMORY_SHARE)                  # 70% holds the slots, not the model
    monkeypatch.setattr(cap, "memory_limit_bytes", lambda: memory)
    assert cap.cap_bounds(index, 8)[1] >= want                                   # the slots alone would fit
    with pytest.raises(ValueError, match="less the model's dense weights and KV cache"):
        ExpertCache(model, want)
    monkeypatch.setattr(cap, "memory_limit_bytes", lambda: int((want + reserved) / cap.MAX_MEMORY_SHARE) + 1)
    with ExpertCache(model, want) as cache:
        assert cache.cap_bytes == want and cache.reserved_bytes == reserved


def test_a_kv_budget_that_leaves_no_room_for_any_cap_says_so(model):
    index = Index.load(model / INDEX)
    with pytest.raises(ValueError, match=r"no cache cap fits: .* smaller KV budget \(serve --kv-budget\)"):
        ExpertCache(model, 8 * index.n_layers * index.slot_bytes, kv_positions=10**12)
