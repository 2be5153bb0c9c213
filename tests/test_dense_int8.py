"""--dense int8: the dense linears quantized as the model loads (agent/model/dense_int8.py), within the
bound symmetric int8 allows, the rest of the model exact, the same on one worker as on two."""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)

from agent.convert import convert
from agent.experts import quant
from agent.experts.provider import InMemoryExperts
from agent.generate import run_generate
from agent.model import dense_int8
from agent.model.dense_int8 import Int8Linear
from agent.model.loading import load_model
from agent.model.model import Linear
from agent.serve.runtime import Runtime, ServeOptions
from hf_models import tiny_checkpoint
from test_convert import CLI, REPO

PROMPT = torch.randint(0, 250, (24,), generator=torch.Generator().manual_seed(5)).tolist()
# Largest |logit difference| int8 dense may make on these tiny random bf16 models, as a share of the largest
# logit: measured 8-11% (int8 experts on such models: 8-42%, BENCHMARKS.md; bench/quant_error.py measures both)
LOGIT_SHARE = 0.2
LIBC = ctypes.CDLL(None, use_errno=True)


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(2.0 ** -126))) - 7)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """bf16 stores whose widths the int8 kernel takes: OLMoE; Qwen2-MoE (qkv bias, a shared expert) with its
    LM head tied to the embeddings; DeepSeek-V2 (MLA, a dense first layer, shared experts)."""
    tmp = tmp_path_factory.mktemp("dense")
    widths = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
    archs = {"olmoe": dict(intermediate_size=64), "qwen2_moe": dict(tie_word_embeddings=True),
             "deepseek_v2": dict(kv_lora_rank=32, q_lora_rank=None)}
    out = {}
    for arch, extra in archs.items():
        ckpt = tiny_checkpoint(arch, tmp / arch / "hf", dtype=torch.bfloat16, **widths, **extra)
        convert(ckpt.path, tmp / arch / "store", quantize=None)
        out[arch] = tmp / arch / "store"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,activations", [(1, True), (3, True), (12, False), (12, True)])
def test_each_output_is_within_half_a_step_of_every_weight_and_activation(dtype, tokens, activations):
    """|error| <= |x| . (scale / 2) of the weights' rounding, + |w| . (x_scale / 2) where the activations are
    quantized too (W8A8: bf16 above 8 tokens), + two roundings of the output to its dtype."""
    g = torch.Generator().manual_seed(tokens)
    linear = Linear(256, 96, bias=True, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(tokens, 256, generator=g).to(dtype)
    int8 = Int8Linear.of(linear, activations)
    with torch.inference_mode():
        got = int8(x).double()
    w, x64 = linear.weight.double(), x.double()
    exact = x64 @ w.T + linear.bias.double()
    bound = x64.abs() @ int8.scale.double()[None, :].expand(256, -1) / 2   # [t, out]
    if activations and dtype == torch.bfloat16 and tokens > 8:
        x_scale = x64.abs().amax(dim=1, keepdim=True) / 127
        bound = bound + x_scale * w.abs().sum(dim=1)[None, :] / 2
    if dtype == torch.bfloat16:
        bound = bound + 2 * bf16_ulp(exact)
    assert got.shape == (tokens, 96) and int8.q.dtype == torch.int8
    assert ((got - exact).abs() <= bound * 1.01 + 1e-5).all()
    assert ((got - exact).abs() > 0).any()        # it is quantized: not the float result


def logits(model, ids: list[int]) -> torch.Tensor:
    seq = model.new_sequence(len(ids))
    return torch.cat([model.step([(seq, torch.tensor([t]))], all_logits=True)[0] for t in ids])


@pytest.mark.parametrize("arch", ["olmoe", "qwen2_moe", "deepseek_v2"])
def test_only_the_dense_linears_turn_int8_and_the_logits_stay_close(stores, arch):
    store = stores[arch]
    stored = load_model(store, InMemoryExperts(store), prefetch=False)
    int8 = load_model(store, InMemoryExperts(store), prefetch=False, dense="int8")
    linears = {name for name, m in stored.named_modules() if isinstance(m, Linear)}
    assert {name for name, m in int8.named_modules() if isinstance(m, Int8Linear)} == linears
    assert "lm_head" in linears and not any(isinstance(m, Linear) for m in int8.modules())
    int8_state = int8.state_dict()   # what is left a parameter: embeddings, norms, routers, MLA's kv_b_proj
    assert int8_state and all(torch.equal(v, stored.state_dict()[k]) for k, v in int8_state.items())
    assert (arch == "deepseek_v2") == any(k.endswith("kv_b_proj.weight") for k in int8_state)
    if arch == "qwen2_moe":   # tied: the head has its own int8 copy, the embedding stays exact
        assert stored.config.tie_embeddings and torch.equal(stored.lm_head.weight, stored.embed_tokens.weight)
        assert torch.equal(int8.embed_tokens.weight, stored.embed_tokens.weight)
    ref, got = logits(stored, PROMPT), logits(int8, PROMPT)
    assert 0 < (got - ref).abs().max() <= LOGIT_SHARE * ref.abs().max()


def test_generate_and_serve_load_it_and_refuse_a_mode_they_do_not_know(stores):
    store = stores["olmoe"]
    run = run_generate(store, prompt_ids=PROMPT[:4], max_new_tokens=4, greedy=True, dense="int8")
    assert len(run.token_ids) == 4 and run.stats["dense"] == "int8"
    with pytest.raises(ValueError, match=r"dense must be one of \('stored', 'int8'\), got 'int4'"):
        run_generate(store, prompt_ids=PROMPT[:4], max_new_tokens=1, dense="int4")
    with pytest.raises(ValueError, match="dense must be one of"):
        ServeOptions(store, dense="int4")
    for command in (["generate", "--prompt-ids", "1"], ["serve"]):
        bad = subprocess.run(CLI + command + ["--model", str(store), "--dense", "int4"], cwd=REPO,
                             capture_output=True, text=True)
        assert bad.returncode == 2
        assert "argument --dense: invalid choice: 'int4' (choose from 'stored', 'int8')" in bad.stderr, bad.stderr
    rt = Runtime(ServeOptions(store, cache_cap="100%", dense="int8"), CollectorRegistry())
    rt.start()
    try:
        assert rt.status(0)["dense"] == "int8" and isinstance(rt.engine.model.lm_head, Int8Linear)
    finally:
        rt.stop()


def cached_pages(path: Path) -> int:
    """Pages of the file in the page cache (mincore over a mapping made only to ask)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        vec = ctypes.create_string_buffer(-(-len(m) // mmap.PAGESIZE))
        view = np.frombuffer(m, dtype=np.uint8)
        done = LIBC.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(len(m)), vec)
        del view   # the mapping closes only once nothing exports it
        assert done == 0, ctypes.get_errno()
        return sum(b & 1 for b in vec.raw)


@pytest.mark.parametrize("dense", ["stored", "int8"])
def test_the_dense_weights_are_read_into_the_process_not_mapped_nor_left_cached(stores, dense):
    """Mapped, the stored matrices' pages would stay charged after int8 replaced them (the embeddings still
    point into the mapping: +2.1 GB at Qwen1.5-MoE's shape), and as stored they could be dropped under
    pressure and faulted back in mid-token; the memory rule counts the dense weights whole and resident.
    Nor may the file's pages stay in the page cache once read: they would crowd the agent's cgroup."""
    store = stores["qwen2_moe"]
    path = store / "dense.safetensors"
    with open(path, "rb") as f:
        os.fsync(f.fileno())             # written just now by convert: dirty pages cannot be dropped
        f.read()
    assert cached_pages(path) > 0        # the check below can fail
    model = load_model(store, InMemoryExperts(store), prefetch=False, dense=dense)
    assert str(path) not in Path("/proc/self/maps").read_text() and model.embed_tokens.weight.is_contiguous()
    assert cached_pages(path) == 0


def test_one_tokens_matvecs_split_over_two_workers_give_the_one_workers_logits(stores, monkeypatch):
    store = stores["olmoe"]
    monkeypatch.setattr(dense_int8, "SPLIT_MIN_BYTES", 0)      # split every one-token int8 matvec
    calls, real = [], dense_int8.linear_int8
    monkeypatch.setattr(dense_int8, "linear_int8", lambda x, q, *a: calls.append(q.shape[0]) or real(x, q, *a))
    one, two = (logits(load_model(store, InMemoryExperts(store), prefetch=False, workers=w, dense="int8"), PROMPT)
                for w in (1, 2))
    assert torch.equal(one, two)
    assert 128 // 8 in calls and 128 in calls   # parts on two workers (8 of a q_proj); whole on one


def test_quantizing_by_rows_is_quantizing_the_whole_matrix(monkeypatch):
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    monkeypatch.setattr(dense_int8, "QUANTIZE_ROWS", 16)      # 16, 16, 16 and 2 rows
    whole, parts = quant.quantize_rows(w, torch.bfloat16), dense_int8.quantize_by_rows(w, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))
