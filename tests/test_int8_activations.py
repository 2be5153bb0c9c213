"""--int8-activations on|off: whether int8 experts of a bf16 model quantize their activations too (W8A8)
where an expert has more tokens than the int8 kernel takes; a model-load option of generate and serve,
carried by the expert cache to every expert it hands out."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry

from agent.convert import convert
from agent.experts import quant
from agent.experts.cache import ExpertCache
from agent.experts.layout import INDEX, Index
from agent.experts.provider import InMemoryExperts
from agent.generate import run_generate
from agent.model.loading import load_model
from agent.serve.runtime import Runtime, ServeOptions
from hf_models import tiny_checkpoint
from test_convert import CLI, REPO

PROMPT = torch.randint(0, 250, (48,), generator=torch.Generator().manual_seed(3)).tolist()  # 96 routings, 8 experts


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory):
    """A bf16 OLMoE whose widths the int8 kernel takes (multiples of 16), its experts int8."""
    tmp = tmp_path_factory.mktemp("int8")
    ckpt = tiny_checkpoint("olmoe", tmp / "hf", dtype=torch.bfloat16, hidden_size=128, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=4)
    convert(ckpt.path, tmp / "int8", quantize="int8")
    return tmp / "int8"


class Explicit:
    """The store's int8 experts, each matmul computed by the function named here: torch's int8 kernel up to
    INT8_KERNEL_MAX_TOKENS tokens, `wide` above. Keeps how many tokens each expert call had."""

    def __init__(self, store, wide) -> None:
        self.inner, self.wide, self.tokens = InMemoryExperts(store), wide, []

    def route(self, layer, experts):
        pass

    def prefetch(self, layer, experts):
        pass

    def done(self, layer, expert):
        pass

    def get(self, layer, expert):
        e = self.inner.get(layer, expert)

        def linear(x, q, scale):
            return (quant.linear_int8_kernel if x.shape[0] <= quant.INT8_KERNEL_MAX_TOKENS else self.wide)(x, q, scale)

        def swiglu(x):
            self.tokens.append(x.shape[0])
            gate, up = linear(x, e.gate_up, e.gate_up_scale).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, e.down, e.down_scale)
        return swiglu


def prefill_logits(store, provider) -> torch.Tensor:
    """The prompt in one step: many tokens per expert."""
    model = load_model(store, provider)
    return model.step([(model.new_sequence(len(PROMPT)), torch.tensor(PROMPT))], all_logits=True)[0]


def test_off_computes_weights_only_int8_and_on_quantizes_the_activations(int8_store):
    index = Index.load(int8_store / INDEX)
    got = {}
    for on in (True, False):
        with ExpertCache(int8_store, index.nbytes * len(index.blocks), int8_activations=on) as cache:
            got[on] = prefill_logits(int8_store, cache)
        torch.testing.assert_close(prefill_logits(int8_store, InMemoryExperts(int8_store, int8_activations=on)),
                                   got[on], atol=0, rtol=0)
    w8a8, weights_only = Explicit(int8_store, quant.linear_int8_w8a8), Explicit(int8_store, quant.linear_int8_converted)
    torch.testing.assert_close(got[True], prefill_logits(int8_store, w8a8), atol=0, rtol=0)
    torch.testing.assert_close(got[False], prefill_logits(int8_store, weights_only), atol=0, rtol=0)
    assert max(w8a8.tokens) > quant.INT8_KERNEL_MAX_TOKENS >= min(w8a8.tokens)  # both paths were taken
    assert not torch.equal(got[True], got[False])  # and they differ: the switch changed the compute


def test_generate_says_which_and_refuses_a_value_that_is_not_on_or_off(int8_store):
    off = run_generate(int8_store, prompt_ids=PROMPT[:4], max_new_tokens=2, greedy=True,
                       int8_activations=False)
    assert off.stats["int8_activations"] is False
    done = subprocess.run(CLI + ["generate", "--model", str(int8_store), "--prompt-ids", "1,2,3", "--max-new-tokens",
                                 "2", "--greedy", "--int8-activations", "off", "--json"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["int8_activations"] is False
    for command in (["generate", "--prompt-ids", "1"], ["serve"]):
        bad = subprocess.run(CLI + command + ["--model", str(int8_store), "--int8-activations", "maybe"], cwd=REPO,
                             capture_output=True, text=True)
        assert bad.returncode == 2
        assert "argument --int8-activations: expected on or off, got 'maybe'" in bad.stderr, bad.stderr


@pytest.mark.parametrize("on", [True, False])
def test_the_runtime_opens_its_cache_with_the_option_and_status_reports_it(int8_store, on):
    rt = Runtime(ServeOptions(int8_store, cache_cap="100%", int8_activations=on), CollectorRegistry())
    rt.start()
    try:
        assert rt.cache.int8_activations is on
        assert rt.status(0)["experts"] == {"quant": "int8", "dtype": "bfloat16", "int8_activations": on}
    finally:
        rt.stop()
