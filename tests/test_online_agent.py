"""Online learning in the running agent under batched serving: `flashmoe-cli serve` on loopback, the demo
model, concurrent clients. A batched step routes the union of its requests' experts, more than a layer's
slots hold; the learner's window replays must take such steps as the cache does, or every update fails."""
from __future__ import annotations

import concurrent.futures
import time

import httpx

from agents import demo_model, start_agent, wait_for

CLIENTS = 4
PROMPTS = ["Tell me about the printing press.", "Write a short poem about the sea.",
           "Explain how a hash map works.", "What should I pack for a week of hiking?"]


def test_a_serving_agent_learns_online_from_batched_steps_and_swaps_the_weights(tmp_path_factory, tmp_path):
    agent = start_agent(demo_model(tmp_path_factory), tmp_path, "--cache-cap", "25%", "--policy", "flashmoe")
    try:
        assert httpx.put(agent.url + "/v1/knobs", json={"online_learning": True}, timeout=60).status_code == 200
        slots_per_layer = agent.get("/v1/status").json()["cache"]["capacity_experts"] // 2  # the small demo: 2 layers
        before, learning = agent.get("/v1/status").json(), {}
        deadline = time.monotonic() + 600
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            while time.monotonic() < deadline:
                list(pool.map(lambda p: agent.complete(prompt=p, max_tokens=24, temperature=0), PROMPTS))
                learning = agent.get("/v1/status").json()["online_learning"]
                if learning["updates"] or learning["worker_failures"]:
                    break
        after = agent.get("/v1/status").json()
        assert after["model_steps"] - before["model_steps"] < after["tokens_generated"] - before["tokens_generated"]
        assert slots_per_layer < CLIENTS * 8  # 4 requests' top-8 unions can exceed a layer's slots
        assert learning["worker_failures"] == 0, agent.log.read_text()[-3000:]
        assert learning["updates"] >= 1 and all(u["decisions"] > 0 for u in learning["recent"])
        wait_for(lambda: agent.metric("flashmoe_online_updates_total") >= 1,   # counted at the next tick
                 what="the update in /metrics")
    finally:
        assert agent.stop() == 0


