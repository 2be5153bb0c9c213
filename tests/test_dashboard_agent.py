"""Dashboard pages against a real agent (`flashmoe-cli serve --token` on the small demo model, loopback).

The agent requires a bearer token on control calls and the dashboard has it in FLASHMOE_TOKEN.
The Tuning page applies knobs and shows the agent's answer, the Memory page applies its
recommendation, the Cache page runs a cap sweep through /v1/completions and restores the cap;
a dashboard without the token, or with a wrong one, is refused and says what to set. Exposed
(server.address 0.0.0.0), a session must enter the token before any knob is sent (a click forced
on the disabled button sends nothing either); without a token the dashboard is read-only.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from streamlit import config
from streamlit.testing.v1 import AppTest

from access.guesses import FREE_GUESSES
from agents import ROOT, demo_model, free_port, start_agent
from bench import synthetic
from dashboard import agent_client, auth, data, pages, sweep
from store import queries
from store.units import human

APP = str(ROOT / "dashboard" / "app.py")
TOKEN = "control-token-for-tests"
MIB = 1 << 20


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    a = start_agent(demo_model(tmp_path_factory), tmp_path_factory.mktemp("agent"), "--token", TOKEN)
    try:
        yield a.url, a.db
    finally:
        a.stop()


def knob(url: str, name: str):
    return httpx.get(f"{url}/v1/knobs").json()[name]


def open_page(monkeypatch, db: Path, url: str, page: str, token: str | None = TOKEN) -> AppTest:
    monkeypatch.setenv("FLASHMOE_DB", str(db))
    monkeypatch.setenv("FLASHMOE_AGENT_URL", url)
    if token is None:
        monkeypatch.delenv(agent_client.TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(agent_client.TOKEN_ENV, token)
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.switch_page(pages.page(page).path).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def slider(at: AppTest, label: str):
    return next(w for w in at.slider if w.label == label)


def another_cap(cap: dict) -> int:
    """A whole number of MiB other than the cap, within its bounds: what a user picks on the slider."""
    up = (cap["value"] // MIB + 1) * MIB
    return up if up <= cap["max"] else -(-cap["min"] // MIB) * MIB


def test_tuning_applies_the_cap_chosen_on_its_slider_and_shows_the_agents_answer(monkeypatch, agent):
    url, db = agent
    cap = knob(url, "cache_cap_bytes")
    new = another_cap(cap)
    at = open_page(monkeypatch, db, url, "tuning")
    assert "Agent online" in texts(at.success)
    bar = slider(at, "cache_cap_bytes")
    expert_bytes = httpx.get(f"{url}/v1/status").json()["cache"]["expert_bytes"]
    # the agent's bounds in MiB, the top no higher than all the model's experts (or the cap)
    assert (bar.min, bar.max) == (cap["min"] / MIB, min(cap["max"], max(expert_bytes, cap["value"])) / MIB)
    assert "allowed" in bar.help and all(w.help for w in [*at.number_input, *at.toggle, *at.selectbox]
                                         if w.key not in ("window", "refresh"))
    bar.set_value(new / MIB)
    at.button[0].click().run()
    assert f"accepted: cache_cap_bytes = {human(new, 'B')}" in texts(at.success)
    assert knob(url, "cache_cap_bytes")["value"] == new
    table, history = at.table[0].value, at.dataframe[0].value
    assert table.loc["cache_cap_bytes", "value"] == human(new, "B")
    latest = history.iloc[0]
    assert (latest["knob"], latest["new"], latest["source"]) == ("cache_cap_bytes", human(new, "B"), "dashboard")


def test_the_cap_can_be_chosen_in_gib_or_percent_of_expert_bytes(monkeypatch, agent):
    url, db = agent
    expert_bytes = httpx.get(f"{url}/v1/status").json()["cache"]["expert_bytes"]
    cap = knob(url, "cache_cap_bytes")
    at = open_page(monkeypatch, db, url, "tuning")
    at.segmented_control(key="cap-unit").set_value("% of experts").run()
    bar = slider(at, "cache_cap_bytes")
    assert bar.max == pytest.approx(100 * min(cap["max"], max(expert_bytes, cap["value"])) / expert_bytes)
    pct = 50.0 if 50.0 * expert_bytes / 100 <= cap["max"] else bar.min
    bar.set_value(pct)
    at.button[0].click().run()
    assert knob(url, "cache_cap_bytes")["value"] == max(round(pct * expert_bytes / 100), cap["min"])


def test_the_cap_slider_shows_a_cap_below_one_mib_as_it_is_and_steps_finely_on_a_small_model(monkeypatch, agent):
    """Whole MiB showed the demo's 768 KiB as "1 MiB", and its 3 MiB of experts took three steps."""
    url, db = agent
    with set_cap(url, 768 << 10):
        bar = slider(open_page(monkeypatch, db, url, "tuning"), "cache_cap_bytes")
        assert bar.proto.format % bar.value == "0.75 MiB"  # the slider's text: the browser's sprintf of the same
        assert (bar.max - bar.min) / bar.step >= 100


def test_a_float_knob_shows_its_value_as_it_is(monkeypatch, agent):
    """keep_percentile 37.5 showed as "38": a range over 10 took whole steps and no decimals."""
    url, db = agent
    put = functools.partial(httpx.put, f"{url}/v1/knobs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=90)
    before = knob(url, "keep_percentile")["value"]
    assert put(json={"keep_percentile": 37.5}).status_code == 200
    try:
        box = next(w for w in open_page(monkeypatch, db, url, "tuning").number_input if w.label == "keep_percentile")
        assert box.proto.format % box.value == "37.5"
    finally:
        assert put(json={"keep_percentile": before}).status_code == 200


def test_the_dashboards_status_poll_asks_for_no_step_profiles(agent):
    """Every live fragment polls /v1/status and no page shows the steps' profiles (256 by default)."""
    url, _ = agent
    httpx.post(f"{url}/v1/completions", json={"prompt": "a few steps", "max_tokens": 3}, timeout=60).raise_for_status()
    assert httpx.get(f"{url}/v1/status").json()["step_profiles"]
    assert data.agent_status(url, TOKEN)["step_profiles"] == []


def test_a_refused_change_is_the_agents_validation_error_and_changes_nothing(agent):
    url, _ = agent
    before = knob(url, "cache_cap_bytes")
    accepted, text = data.apply_knobs(url, TOKEN, {"cache_cap_bytes": before["min"] - 1})
    assert not accepted
    assert "refused (400)" in text and "cache_cap_bytes must be between" in text
    assert knob(url, "cache_cap_bytes")["value"] == before["value"]


def test_a_dashboard_without_the_token_is_refused_and_says_what_to_set(monkeypatch, agent):
    url, db = agent
    before = knob(url, "cache_cap_bytes")
    at = open_page(monkeypatch, db, url, "tuning", token=None)
    assert "Agent online" in texts(at.success)          # reading needs no token
    slider(at, "cache_cap_bytes").set_value(another_cap(before) / MIB)
    at.button[0].click().run()
    error = texts(at.error)
    assert "refused (401)" in error and "start the dashboard with FLASHMOE_TOKEN set" in error
    assert knob(url, "cache_cap_bytes")["value"] == before["value"]


@pytest.mark.parametrize("page, says_why", [("overview", True), ("tuning", True), ("cache", True), ("memory", False)])
def test_an_address_that_is_html_server_is_no_traceback(monkeypatch, tmp_path, html_server, page, says_why):
    """Each page that reads the agent showed a JSONDecodeError's traceback; the agent's own pages say why."""
    db = tmp_path / "flashmoe.db"
    synthetic.write(str(db), synthetic.Spec(start=time.time() - 120, seconds=120))
    at = open_page(monkeypatch, db, html_server, page)   # no exception: open_page checks
    shown = texts([*at.error, *at.warning, *at.info, *at.caption])
    assert (f"{html_server} is not a FlashMoE agent" in shown) == says_why, shown
    answer = agent_client.Agent(html_server).push({"prefetch": True})
    assert answer.startswith(f"not sent: {html_server} is not a FlashMoE agent: it answered PUT /v1/knobs "
                             f"with ` text/html `")


@pytest.mark.parametrize("page, read", [("overview", "GET /v1/status without ` policy `"),
                                        ("cache", "GET /v1/status without ` policy `"),
                                        ("tuning", "GET /v1/knobs with ` x ` not an object")])
def test_an_address_that_answers_json_of_another_shape_is_named_in_one_line(monkeypatch, tmp_path, json_server,
                                                                            page, read):
    """A JSON service that is not the agent ({"x": 1} to everything) was a KeyError's box on the Overview, Cache
    and Tuning pages."""
    db = tmp_path / "flashmoe.db"
    synthetic.write(str(db), synthetic.Spec(start=time.time() - 120, seconds=120))
    at = open_page(monkeypatch, db, json_server, page)   # no exception: open_page checks
    shown = texts([*at.error, *at.warning, *at.info, *at.caption])
    assert f"{json_server} is not a FlashMoE agent: it answered {read}" in shown, shown
    answer = agent_client.Agent(json_server).push({"prefetch": True})
    assert answer.startswith(f"not sent: {json_server} is not a FlashMoE agent: it answered PUT /v1/knobs with "
                             f"` x ` not an object"), answer


def test_a_push_to_an_agent_too_busy_to_answer_says_it_was_sent_and_an_absent_one_that_it_was_not(monkeypatch):
    """A thrashing agent takes the change and may still apply it: "not sent" would be wrong."""
    monkeypatch.setattr(agent_client, "KNOBS_TIMEOUT_S", 1.0)
    with socket.socket() as listener:   # takes connections into its backlog, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        busy = f"http://127.0.0.1:{listener.getsockname()[1]}"
        assert agent_client.Agent(busy).push({"prefetch": True}).startswith(
            f"sent, no answer: the agent at {busy} took the request but did not answer within 1 s")
        with pytest.raises(agent_client.AgentBusy, match="within 3 s: it is running but busy"):
            agent_client.Agent(busy).knobs()
    absent = f"http://127.0.0.1:{free_port()}"
    answer = agent_client.Agent(absent).push({"prefetch": True})
    assert answer.startswith(f"not sent: the agent at {absent} did not answer (ConnectError)")


def test_an_answer_that_drips_or_never_ends_is_cut_off_in_time_and_size(hostile_target):
    """httpx's timeout is per read: an answer dripping a byte every 0.1 s never timed out (a Fleet push to such a
    target waited for ever), and one of 4 GB was read whole (10 GB of the dashboard's memory)."""
    url, sent = hostile_target
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        started = time.monotonic()
        dripping = pool.submit(agent_client.Agent(url).status)
        with pytest.raises(agent_client.AgentBusy, match="did not answer within 3 s"):
            dripping.result(timeout=15)
        assert time.monotonic() - started < 5
    finally:
        pool.shutdown(wait=False)      # a read that never ends stops with the server
    with pytest.raises(agent_client.AgentError, match=f"{url} is not a FlashMoE agent: it answered GET /v1/knobs "
                                                     f"with more than 4 MiB"):
        agent_client.Agent(url).knobs()
    assert sent[0] < 16 * MIB          # the rest was never asked for


def test_a_wrong_token_is_refused_by_name(agent):
    url, _ = agent
    answer = agent_client.Agent(url, "not-the-token").put_knobs({"prefetch": True})
    assert (answer.accepted, answer.status_code) == (False, 401)
    assert "the dashboard's FLASHMOE_TOKEN is not the agent's token" in answer.detail


def test_memory_recommendation_is_applied_through_the_knobs_api(monkeypatch, agent, tmp_path):
    url, _ = agent
    thrash_db = tmp_path / "thrash.db"      # the collector's view of a thrashing box
    synthetic.write(str(thrash_db), synthetic.Spec(start=time.time() - 300, seconds=300, memory="agent thrashing"))
    lowest = knob(url, "cache_cap_bytes")["min"]
    with set_cap(url, 4 * MIB + lowest):    # room for two steps of a quarter down
        at = open_page(monkeypatch, thrash_db, url, "memory")
        assert "Agent thrashing" in texts(at.error)
        expected = (3 * MIB + lowest * 3 // 4) // MIB * MIB                       # a quarter less, in whole MiB
        button = at.button(key="apply-recommendation")
        assert button.label == f"Apply: cache_cap_bytes = {human(expected, 'B')}" and not button.disabled
        button.click().run()
        assert knob(url, "cache_cap_bytes")["value"] == expected
        assert f"accepted: cache_cap_bytes = {human(expected, 'B')}" in texts(at.success)
        assert "Since the change:" in texts(at.markdown) and "agent major faults: 400 /s before" in texts(at.markdown)
        # the verdict still covers the minutes before the change: no second step until the change shows
        at.run()
        assert "Shrink the cache cap from" in texts(at.markdown)
        assert "apply-recommendation" not in [b.key for b in at.button]
        assert "is taking hold: the next recommendation waits" in texts(at.caption)


@contextlib.contextmanager
def set_cap(url: str, cap: int) -> Iterator[None]:
    before = knob(url, "cache_cap_bytes")["value"]
    put = functools.partial(httpx.put, f"{url}/v1/knobs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=90)
    assert put(json={"cache_cap_bytes": cap}).status_code == 200
    try:
        yield
    finally:
        assert put(json={"cache_cap_bytes": before}).status_code == 200


def test_a_refused_recommendation_is_shown_in_red(monkeypatch, agent, tmp_path):
    url, _ = agent
    thrash_db = tmp_path / "thrash.db"
    synthetic.write(str(thrash_db), synthetic.Spec(start=time.time() - 300, seconds=300, memory="agent thrashing"))
    before = knob(url, "cache_cap_bytes")["value"]
    at = open_page(monkeypatch, thrash_db, url, "memory", token=None)
    at.button(key="apply-recommendation").click().run()
    assert "refused (401)" in texts(at.error)
    assert "Since the change" not in texts(at.markdown)
    assert knob(url, "cache_cap_bytes")["value"] == before


def test_cache_sweep_measures_each_cap_stores_the_curve_and_restores_the_cap(monkeypatch, agent):
    url, db = agent
    original = knob(url, "cache_cap_bytes")["value"]
    at = open_page(monkeypatch, db, url, "cache")
    at.number_input(key="sweep-requests").set_value(1)
    at.number_input(key="sweep-tokens").set_value(2)
    at.button(key="start-sweep").click().run()
    runner = data.sweep_runner()
    runner.join(300)
    assert not runner.running and not runner.progress.error, runner.progress.error
    caps = [p.cache_cap_bytes for p in runner.progress.points]
    stored = queries.sweeps(db)
    assert sorted({r["cache_cap_bytes"] for r in stored}) == sorted(caps) and len(caps) >= 2
    assert all(r["tokens_per_s"] > 0 and 0 <= r["hit_rate"] <= 1 for r in stored)
    assert knob(url, "cache_cap_bytes")["value"] == original
    data.sweeps.clear()
    at.run()
    curve = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                 if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Tokens/s by cache cap"))
    assert curve["data"][0]["x"] == [c / 2**20 for c in sorted(caps)]


def test_a_refused_sweep_says_why_and_still_restores_the_cap(agent):
    url, db = agent
    before = knob(url, "cache_cap_bytes")
    runner = sweep.SweepRunner()
    runner.start(data.agent(url, TOKEN), str(db), [before["min"] - 1], n_requests=1, max_tokens=1)
    runner.join(60)
    assert "refused cache_cap_bytes" in runner.progress.error
    assert runner.progress.status == "failed" and not runner.progress.points
    assert knob(url, "cache_cap_bytes")["value"] == before["value"]


# -- exposed: the auth gate (dashboard/auth.py) ---------------------------------------------------------
@pytest.fixture
def exposed() -> Iterator[None]:
    before = config.get_option("server.address")
    config.set_option("server.address", "0.0.0.0")
    try:
        yield
    finally:
        config.set_option("server.address", before)


def prefetch(url: str) -> bool:
    return httpx.get(f"{url}/v1/knobs").json()["prefetch"]["value"]


def apply_prefetch(at: AppTest, value: bool, forced: bool = False) -> AppTest:
    """Toggle prefetch and press Apply; `forced` as a hostile browser would, disabled widgets or not."""
    toggle = next(t for t in at.toggle if t.label == "prefetch")
    button = next(b for b in at.button if b.label == "Apply")
    if forced:
        toggle.proto.disabled = button.proto.disabled = False
    toggle.set_value(value)
    return button.click().run()


def test_an_exposed_dashboard_sends_nothing_before_the_token_is_entered(monkeypatch, agent, exposed):
    url, db = agent
    before = prefetch(url)
    at = open_page(monkeypatch, db, url, "tuning")
    assert "control is locked" in texts(at.info)
    assert next(b for b in at.button if b.label == "Apply").disabled
    apply_prefetch(at, not before, forced=True)
    assert "accepted" not in texts(at.success) and prefetch(url) == before

    at.text_input[0].set_value("a guess")
    next(b for b in at.button if b.label == "Unlock control").click().run()
    assert "not the agent's token" in texts(at.error) and auth.UNLOCKED not in at.session_state

    at.text_input[0].set_value(TOKEN)
    next(b for b in at.button if b.label == "Unlock control").click().run()
    assert at.session_state[auth.UNLOCKED] and "Unlocked" in texts(at.caption)
    apply_prefetch(at, not before)
    assert f"accepted: prefetch = {str(not before).lower()}" in texts(at.success) and prefetch(url) == (not before)
    httpx.put(f"{url}/v1/knobs", json={"prefetch": before}, headers={"Authorization": f"Bearer {TOKEN}"})


def unlock(at: AppTest, token: str) -> AppTest:
    at.text_input[0].set_value(token)
    return next(b for b in at.button if b.label == "Unlock control").click().run()


def test_wrong_tokens_lock_the_form_out_for_a_while_even_in_a_new_session(monkeypatch, agent, exposed):
    """The Unlock control form heard wrong tokens without end at full speed, and a new session was one reload away."""
    url, db = agent
    now = [0.0]
    auth._guesses.clear()
    auth._guesses().clock = lambda: now[0]    # the process's one limit, every session's: a 1 s lock-out, not a race
    at = open_page(monkeypatch, db, url, "tuning")
    for i in range(FREE_GUESSES):
        assert texts(unlock(at, f"guess-{i}").error) == "That is not the agent's token."
    assert "Too many wrong tokens from this address: it is locked out for 1 s more" in texts(unlock(at, "guess").error)
    again = open_page(monkeypatch, db, url, "tuning")     # a new browser session, same address
    assert "locked out" in texts(unlock(again, TOKEN).error) and auth.UNLOCKED not in again.session_state
    now[0] += 1
    assert auth.UNLOCKED in unlock(again, TOKEN).session_state


def test_an_exposed_dashboard_without_a_token_is_read_only(monkeypatch, agent, exposed):
    url, db = agent
    before = prefetch(url)
    at = open_page(monkeypatch, db, url, "tuning", token=None)
    assert "Agent online" in texts(at.success)          # reading needs no token
    assert "has no FLASHMOE_TOKEN" in texts(at.caption) and not at.text_input
    apply_prefetch(at, not before, forced=True)
    assert "accepted" not in texts(at.success) and prefetch(url) == before
