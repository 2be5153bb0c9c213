"""Trace-driven routing: recorded routing decides each token's experts while the router, the reads
and the cache stay real; a trace that does not fit the model is refused; outputs say they used it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import tiny_checkpoint
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)

from agent.cli import main as cli
from agent.experts.provider import InMemoryExperts
from agent.model.generation import generate
from agent.model.loading import load_model
from agent.model.route_trace import RouteTrace
from agent.traces import TraceError, read_jsonl

LAYERS, EXPERTS, TOP_K = 3, 8, 2


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("route-trace")
    ckpt = tiny_checkpoint("olmoe", tmp / "hf", num_hidden_layers=LAYERS, eos_token_id=None)
    assert cli(["convert", str(ckpt.path), str(tmp / "store")]) == 0
    return tmp / "store"


def write_trace(path: Path, records: list[list[list[int]]], layers: int = LAYERS, top_k: int = TOP_K,
                n_experts: int = EXPERTS) -> Path:
    meta = {"model": "test", "steps": len(records), "layers": layers, "top_k": top_k, "n_experts": n_experts}
    lines = [json.dumps({"meta": meta})] + [json.dumps({"step": s, "routed": {str(l): sets
                                                                              for l, sets in enumerate(r)}})
                                            for s, r in enumerate(records)]
    path.write_text("\n".join(lines) + "\n")
    return path


def records(n: int) -> list[list[list[int]]]:
    """n tokens of routing that the tiny model's own router would not choose: a walk over the experts."""
    return [[sorted({(t + l) % EXPERTS, (3 * t + 5 * l + 1) % EXPERTS} | {(t + l + 4) % EXPERTS})[:TOP_K]
             for l in range(LAYERS)] for t in range(n)]


def test_every_token_takes_its_trace_record_in_order(store, tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", records(40))
    rec = tmp_path / "recorded.jsonl"
    assert cli(["generate", "--model", str(store), "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "6", "--greedy",
                "--cache-cap", "100%", "--no-prefetch", "--route-trace", str(trace), "--record-trace", str(rec),
                "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["routing"] == "routing from trace t.jsonl"
    placed = RouteTrace.load([trace], load_model(store, InMemoryExperts(store)).config).place(torch.tensor([3]))
    got = read_jsonl(rec).dense().tolist()                  # one step per token: prompt, then decode
    want = [records(40)[(placed.start + p) % 40] for p in range(len(got))]
    assert got == want and len(got) == 5 + 6 - 1


def test_the_router_still_weighs_the_imposed_experts(store, tmp_path):
    """Same experts, different router: different outputs, so the gate weights come from the router."""
    trace = [write_trace(tmp_path / "t.jsonl", records(16))]
    a = load_model(store, InMemoryExperts(store), route_trace=trace)
    b = load_model(store, InMemoryExperts(store), route_trace=trace)
    b.layers[0].mlp.gate.weight.data.mul_(3.0)
    logits = [m.step([(m.new_sequence(8), torch.tensor([1, 2, 3]))])[0] for m in (a, b)]
    assert not torch.allclose(*logits)
    plain = load_model(store, InMemoryExperts(store))
    assert not torch.allclose(plain.step([(plain.new_sequence(8), torch.tensor([1, 2, 3]))])[0], logits[0])


def test_a_prompt_is_placed_the_same_way_every_time(store, tmp_path):
    config = load_model(store, InMemoryExperts(store)).config
    paths = [write_trace(tmp_path / f"{i}.jsonl", records(30 + i)) for i in range(3)]
    trace = RouteTrace.load(paths, config)
    prompts = [torch.tensor([i, 7, 9]) for i in range(40)]
    places = [trace.place(p) for p in prompts]
    assert places == [RouteTrace.load(paths, config).place(p) for p in prompts]   # stable across loads
    assert {p.file for p in places} == {0, 1, 2}                                   # prompts spread over files
    assert trace.experts(places[0], 0, 5).shape == (5, LAYERS, TOP_K)


@pytest.mark.parametrize("layers, top_k, n_experts, what", [(LAYERS + 1, TOP_K, EXPERTS, "4 layers"),
                                                             (LAYERS, TOP_K + 1, EXPERTS, "top-3"),
                                                             (LAYERS, TOP_K, EXPERTS * 2, "of 16 experts")])
def test_a_trace_that_does_not_fit_is_refused(store, tmp_path, caplog, layers, top_k, n_experts, what):
    sets = [[list(range(top_k)) for _ in range(layers)] for _ in range(4)]
    trace = write_trace(tmp_path / "bad.jsonl", sets, layers, top_k, n_experts)
    with pytest.raises(TraceError, match=what):
        RouteTrace.load([trace], load_model(store, InMemoryExperts(store)).config)
    assert cli(["generate", "--model", str(store), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                "--route-trace", str(trace)]) == 2
    assert "use a trace recorded from this model's architecture" in caplog.text


def test_a_missing_trace_is_a_one_line_error(store, tmp_path, caplog):
    assert cli(["generate", "--model", str(store), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                "--route-trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in caplog.text


def test_the_agent_serves_with_a_route_trace_and_says_so(store, tmp_path):
    from agents import CLI, spawn, start_agent
    trace = write_trace(tmp_path / "t.jsonl", records(64))
    agent = start_agent(store, tmp_path, "--route-trace", str(trace), "--cache-cap", "100%")
    try:
        assert agent.complete(prompt="Hi there", max_tokens=3)["usage"]["completion_tokens"] == 3
        assert agent.get("/v1/status").json()["routing"] == "routing from trace t.jsonl"
    finally:
        assert agent.stop() == 0
    bad = write_trace(tmp_path / "bad.jsonl", [[[0, 1]] * (LAYERS + 1)], layers=LAYERS + 1)
    log = tmp_path / "bad.log"
    proc = spawn([*CLI, "serve", "--model", str(store), "--port", "0", "--route-trace", str(bad)], log)
    assert proc.wait(120) != 0
    assert "bad.jsonl: the trace routes 4 layers" in log.read_text() and "Traceback" not in log.read_text()


def test_co_activation_guesses_what_followed_before_and_nothing_it_never_saw():
    from agent.model.lookahead import CoActivation, Lookahead
    look = Lookahead(CoActivation(n_layers=3, n_experts=8))
    assert look.after_route(0, [1, 2], residual=None) is None        # nothing learned yet: no guess
    assert look.after_route(1, [3, 4], residual=None) is None
    assert look.after_route(0, [1, 2], residual=None) == (1, [3, 4])  # layer 1 followed [1, 2] with [3, 4]
    assert look.after_route(1, [3, 5], residual=None) is None         # layer 2 never seen after layer 1
    assert (look.predicted, look.correct) == (2, 1)
    assert look.after_route(2, [0, 7], residual=None) is None         # the next step's layer 0: never seen after it
    look.after_route(0, [6, 7], residual=None)
    assert look.after_route(1, [3, 5], residual=None) == (2, [0, 7])
    assert look.after_route(2, [0, 7], residual=None) == (0, [6, 7])  # the last layer guesses the next step's first
    assert (look.predicted, look.correct) == (6, 3)


def test_with_a_route_trace_the_lookahead_learns_from_the_trace(store, tmp_path):
    from agent.model.lookahead import CoActivation
    model = load_model(store, InMemoryExperts(store), route_trace=[write_trace(tmp_path / "t.jsonl", records(8))])
    assert isinstance(model.lookahead.predictor, CoActivation)
    generate(model, [1, 2, 3], 20, greedy=True)
    # the 8-record walk repeats: right far more often than a guess that learned nothing (TOP_K of EXPERTS)
    assert model.lookahead.predicted > 0 and model.lookahead.accuracy > 1.5 * TOP_K / EXPERTS


def test_the_last_layer_s_guess_reads_the_next_token_s_first_layer_ahead(store, tmp_path):
    from agent.experts.cache import ExpertCache
    from agent.experts.layout import INDEX, Index
    cache = ExpertCache(store, Index.load(store / INDEX).slot_bytes * LAYERS * 4, policy="lru", prefetch="on")
    try:                                                                     # 4 of a layer's 8 experts
        model = load_model(store, cache, route_trace=[write_trace(tmp_path / "t.jsonl", records(8))])
        generate(model, [1, 2, 3], 20, greedy=True)
        first = cache.stats().layers[0]
    finally:
        cache.close()
    # only the last layer guesses layer 0, whose next step is the next token's; the walk repeats: guesses are used
    assert first.prefetches > 0 and first.prefetch_hits > 0
