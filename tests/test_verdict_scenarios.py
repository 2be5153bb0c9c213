"""The cache verdict, and the false alarms a user would meet, on a real agent serving the demo's load
(`flashmoe-cli traffic`) with its collector, each judged from the store they wrote, as
`flashmoe-cli diagnose --json` gives it, over the window of its own scenario:

(a) the agent's cold start: its first minute reads every expert it meets, and that is not thrash;
(b) another process streaming a 2 GiB file through the page cache: not the agent's fault, and no
    memory pressure either (a stream reads each page once: no refaults);
(c) another process reading the same disk hard with O_DIRECT while the agent reads it: memory is calm;
(d) the cache cap dragged to its minimum over HTTP with the token, as the Tuning page does (the
    README's demo): "cache thrashing" with its evidence and a larger cap within the bounds; that cap
    applied, the verdict clears;
(e) another process reading the disk hard for longer than the window and the baseline's span before it
    (both shrunk for the test): contention, judged against the calm latency remembered from before;
(f) another process writing the disk hard with O_DIRECT: contention, the writer named;
(g) another process appending to its log with an fsync each time, as a database does: no alarm.

One agent serves all of them in this order (the cold start first), so each scenario costs only its own
window.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.experts.layout import drop_page_cache
from agents import CLI, Agent, demo_model, spawn, start_agent, start_collector, stop, wait_for
from dashboard.agent_client import Agent as AgentClient
from store import diagnosis, disk_diagnosis, queries
from test_thrash_scenarios import diagnose, signals

pytestmark = pytest.mark.slow
MIB = 1 << 20
TOKEN = "verdict-scenarios"
COLD_S = 45               # the cold start judged: the agent's first 45 s of serving
NEIGHBOUR_S = 30          # each neighbour's run, longer than SUSTAIN_S: a sustained signal would show
THRASH_WITHIN_S = 60      # the cap dragged down to the verdict
CALM_S = 3 * disk_diagnosis.AVERAGE_S   # a calm disk before the O_DIRECT neighbour: two whole verdict buckets...
CALM_WITHIN_S = 60        # ...waited for this long at most
BIG_FILE = 2048 * MIB
REREADS = "agent.reread_rate"
CACHE_THRASHING = "cache thrashing"
CONTENTION = "disk contention from another process"
SEEN = os.environ.get("FLASHMOE_VERDICTS_SEEN")   # a file to append each scenario's disk verdict to (the write-up)


@dataclass
class Served:
    agent: Agent
    started: float            # when the traffic began
    big_file: Path            # on the agent's disk, out of the page cache


def mean(db: Path, series: str, since: float, until: float) -> float:
    _, values = queries.points(db, series, since, until)
    assert len(values), f"no {series} from {since} to {until}"
    return float(values.mean())


def blames(verdict: dict) -> list[str]:
    """The sustained signals, as the verdict states them."""
    return [s["text"] for s in verdict["signals"] if s["sustained"]]


def disk(verdict: dict, scenario: str) -> dict:
    """The disk verdict, appended to FLASHMOE_VERDICTS_SEEN if set."""
    if SEEN:
        with open(SEEN, "a") as f:
            f.write(json.dumps({"scenario": scenario, **verdict["disk"]}) + "\n")
    return verdict["disk"]


def assert_no_disk_alarm(verdict: dict, scenario: str, ours: str | None = None) -> None:
    """No disk verdict this scenario did not cause. The disk is shared: if another process read it hard
    meanwhile and slowed the agent, naming that process is right; `ours` is the scenario's own reader,
    which is then to be named if the verdict is contention."""
    seen = disk(verdict, scenario)
    assert seen["verdict"] in ("healthy", CONTENTION), seen
    if seen["verdict"] == CONTENTION:
        names = [r["name"] for r in seen["readers"]]
        assert seen["others_read_bytes_per_s"] >= disk_diagnosis.OTHERS_FLOOR and names, seen
        assert ours is None or ours in names, seen


def assert_not_the_agents(verdict: dict) -> None:
    """Neither the agent nor its cache is blamed. The machine is shared: if something else stalled it
    meanwhile (a system signal sustained), that, and only that, is the verdict."""
    mine = [s["text"] for s in verdict["signals"] if s["side"] in ("agent", "cache") and s["sustained"]]
    busy = [s["text"] for s in verdict["signals"] if s["side"] == "system" and s["sustained"]]
    assert not mine and verdict["verdict"] == ("pressure from another process" if busy else "healthy"), \
        (verdict["verdict"], mine, busy)


def quiet(db: Path) -> None:
    """Skip when the machine's memory is not calm before a neighbour starts: another process's thrash
    would be the verdict, rightly, and the scenario could not tell what its neighbour did."""
    busy = blames(diagnose(db, NEIGHBOUR_S))
    if busy:
        pytest.skip(f"another process thrashes the machine: {busy}")


def disk_quiet(db: Path) -> None:
    """Wait up to CALM_WITHIN_S for the last CALM_S of the agent's disk to be calm by the disk verdict's own test
    (`disk_diagnosis.Bucket.calm` of its buckets: the agent reading, other processes reading and writing little,
    the previous scenario's dd gone, the device not busy); skip if it never comes: the agent would have no calm
    stretch to be slowed from (the verdict says so, rightly), and dd would share the blame."""
    def recent() -> tuple[str | None, list[disk_diagnosis.Bucket]]:
        """The agent's disk and the verdict's buckets of it over the last CALM_S (none until the collector has
        split the disk: a scenario run first, right after the start)."""
        until = time.time()
        device = disk_diagnosis.agent_disk(db, until - CALM_S, until)
        grid = disk_diagnosis.Grid.over(until - CALM_S, until, disk_diagnosis.AVERAGE_S)
        return device, [] if device is None else disk_diagnosis.buckets(db, device, grid)

    def calm() -> bool:
        cells = recent()[1]
        return len(cells) == CALM_S / disk_diagnosis.AVERAGE_S and all(b.calm for b in cells)
    try:
        wait_for(calm, CALM_WITHIN_S, "a calm disk")
    except AssertionError:
        device, cells = recent()
        readers = sorted({r["name"] for r in queries.disk_readers(db, device, time.time() - CALM_S, time.time())})
        pytest.skip(f"{device} was not calm for {CALM_WITHIN_S} s: in its last {CALM_S:g} s others read and wrote it "
                    f"at {[round(b.others / MIB) for b in cells]} MiB/s ({readers}), "
                    f"{[round(b.util or 0, 2) for b in cells]} busy, the agent's reads taking "
                    f"{[b.latency for b in cells]} s")


def uncached_file(path: Path, size: int) -> Path:
    """`size` bytes written, synced and dropped from the page cache: a later read comes from the disk."""
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size // MIB}", "conv=fsync"],
                   check=True, capture_output=True)
    drop_page_cache(path)
    return path


def neighbour(path: Path, flag: str, seconds: float, workdir: Path, block: str = "1M") -> float:
    """`dd` reading `path` with `flag` in `block`s again and again for `seconds` (each buffered pass drops
    what it read behind it, so every pass comes from the disk); when it began, from the clock the store
    uses."""
    return looped(f"dd if={path} of=/dev/null bs={block} iflag={flag}", seconds, workdir / f"dd-{flag}.log")


def looped(command: str, seconds: float, log: Path) -> float:
    """`command` run again and again for `seconds`; when it began, from the clock the store uses."""
    loop = (f'end=$(($(date +%s) + {int(seconds)})); while [ $(date +%s) -lt $end ]; do '
            f'{command} 2>/dev/null; done')
    proc = spawn(["sh", "-c", loop], log)
    began = time.time()
    assert proc.wait(seconds + 60) == 0
    return began


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """The small demo model served at its default cap (25%) with the demo's traffic and the collector."""
    workdir = tmp_path_factory.mktemp("verdicts")
    big = uncached_file(workdir / "big.bin", BIG_FILE)
    agent = start_agent(demo_model(tmp_path_factory), workdir, "--token", TOKEN)
    collector = start_collector(agent, workdir)
    traffic = spawn([*CLI, "traffic", "--agent-url", agent.url, "--clients", "2", "--pause", "0"],
                    workdir / "traffic.log")
    try:
        yield Served(agent, time.time(), big)
    finally:
        stop(traffic)
        stop(collector)
        agent.stop()
        big.unlink()


def test_a_cold_start_reading_every_expert_it_meets_is_not_cache_thrashing(served):
    db = served.agent.db
    time.sleep(COLD_S)
    verdict = diagnose(db, COLD_S, served.started + COLD_S)
    first_reads = mean(db, "agent.read_bytes_per_s", served.started, served.started + COLD_S)
    assert first_reads > 0 and mean(db, "agent.hit_rate", served.started, served.started + COLD_S) < 0.9
    assert_not_the_agents(verdict)
    assert_no_disk_alarm(verdict, "cold start")


def test_another_process_streaming_a_file_through_the_page_cache_is_no_memory_trouble(served, tmp_path):
    quiet(served.agent.db)
    began = neighbour(served.big_file, "nocache", NEIGHBOUR_S, tmp_path)
    verdict = diagnose(served.agent.db, time.time() - began)
    assert verdict["verdict"] == "healthy", (verdict["verdict"], blames(verdict))
    assert_no_disk_alarm(verdict, "page-cache stream", ours="dd")
    seen = signals(verdict)
    assert seen["vm.workingset_refault_file_per_s"]["peak"] < seen["vm.workingset_refault_file_per_s"]["threshold"]


def test_another_process_reading_the_disk_hard_is_disk_contention_named_and_no_memory_trouble(served, tmp_path):
    """The agent's reads share the disk with a neighbour's: memory is calm, and the memory verdict says
    so; the disk verdict names dd as what slowed the agent's reads, with the fix for it."""
    db = served.agent.db
    quiet(db)
    disk_quiet(db)
    # 64 MiB reads: the kernel splits each into a queue of requests that the agent's reads wait behind,
    # however fast the host serves them (with 1 MiB ones, one at a time, the agent's reads slowed 30-fold
    # in one run and not at all in another, the host having cached the file)
    began = neighbour(served.big_file, "direct", NEIGHBOUR_S, tmp_path, block="64M")
    busiest = max((mean(db, name, began, time.time()), name) for name in queries.series_names(db)
                  if name.startswith("block.") and name.endswith(".read_bytes_per_s"))
    agent_reads = mean(db, "agent.read_bytes_per_s", began, time.time())
    assert busiest[0] > 4 * agent_reads, (busiest, agent_reads)          # the disk read mostly for the neighbour
    verdict = diagnose(db, time.time() - began)
    assert_not_the_agents(verdict)
    seen = disk(verdict, "O_DIRECT neighbour")
    assert seen["verdict"] == CONTENTION and seen["readers"][0]["name"] == "dd", seen   # the disk was quiet before
    assert seen["latency_s"] > 3 * seen["baseline_latency_s"] and seen["agent_share"] < 0.25, seen
    assert f"ionice -c3 -p {seen['readers'][0]['pids'][-1]}" in seen["recommendation"]["text"], seen


def reads_per_token(db: Path, since: float, until: float) -> float:
    """Expert bytes read per generated token: what a thrashing cache costs, however fast the disk is that
    minute (bytes per second alone fell when the shared disk slowed as the cap fell)."""
    return mean(db, "agent.read_bytes_per_s", since, until) / mean(db, "agent.tokens_per_s", since, until)


def test_a_cap_dragged_far_below_the_working_set_is_cache_thrashing_and_the_raise_it_advises_clears_it(served):
    agent, db = served.agent, served.agent.db
    client = AgentClient(agent.url, TOKEN)
    cap = client.knobs()["cache_cap_bytes"]
    wait_for(lambda: len(queries.points(db, "agent.hit_rate", time.time() - NEIGHBOUR_S, time.time())[1]) >= 10,
             2 * NEIGHBOUR_S, "the served agent's hit rate in the store (when this scenario runs first)")
    before = (mean(db, "agent.hit_rate", time.time() - NEIGHBOUR_S, time.time()),
              reads_per_token(db, time.time() - NEIGHBOUR_S, time.time()))
    assert client.push({"cache_cap_bytes": cap["min"]}).startswith("accepted")
    dragged = time.time()
    try:
        # the last NEIGHBOUR_S since the drag: a window another process's passing thrash has left is judged too
        verdict = wait_for(lambda: (v := diagnose(db, min(time.time() - dragged, NEIGHBOUR_S)))["verdict"]
                           == CACHE_THRASHING and v, THRASH_WITHIN_S, "the verdict to find the cache thrashing")
        rate = signals(verdict)[REREADS]
        assert rate["sustained"] and rate["mean"] > rate["threshold"], rate["text"]
        hit_rate, reads = mean(db, "agent.hit_rate", dragged, time.time()), reads_per_token(db, dragged, time.time())
        assert hit_rate < before[0] and reads > before[1], (before, hit_rate, reads)
        change = verdict["recommendation"]["changes"]["cache_cap_bytes"]
        assert cap["min"] < change <= cap["max"]
        assert verdict["recommendation"]["text"].startswith(f"Raise the cache cap from ")
        assert_no_disk_alarm(verdict, "cap dragged")
        assert "(hit rate 0." in verdict["recommendation"]["text"] and "SSD reads " in verdict["recommendation"]["text"]

        assert client.push({"cache_cap_bytes": change}).startswith("accepted")
        settled = time.time() + diagnosis.SETTLE_S
        time.sleep(diagnosis.SETTLE_S + NEIGHBOUR_S)
        after = diagnose(db, time.time() - settled)
        assert after["verdict"] != CACHE_THRASHING and not signals(after)[REREADS]["sustained"], \
            signals(after)[REREADS]
        assert mean(db, "agent.hit_rate", settled, time.time()) > hit_rate
    finally:   # a failure here must not leave the next scenarios an agent thrashing at its smallest cap
        client.push({"cache_cap_bytes": cap["value"]})


LONG_BASELINE_S = 15      # (e): the baseline's span before the window, shrunk from 300 s...
LONG_WINDOW_S = 25        # ...and the window judged: dd reads through both


def test_another_process_reading_the_disk_for_longer_than_the_verdict_looks_back_is_judged_on_the_calm_before(
        served, tmp_path, monkeypatch):
    """A reader that started before the window and its BASELINE_S, both shrunk for the test (the logic as it
    is): no calm bucket in them, so the agent's calm latency is the one remembered from before dd began."""
    db = served.agent.db
    quiet(db)
    disk_quiet(db)
    monkeypatch.setattr(disk_diagnosis, "BASELINE_S", LONG_BASELINE_S)
    began = neighbour(served.big_file, "direct", LONG_BASELINE_S + LONG_WINDOW_S + 5, tmp_path, block="64M")
    verdict = diagnose(db, LONG_WINDOW_S, until=time.time() - 2)    # ends before dd did: dd read all of it
    assert verdict["until"] - LONG_WINDOW_S - LONG_BASELINE_S > began
    assert_not_the_agents(verdict)
    seen = disk(verdict, "O_DIRECT neighbour longer than the baseline")
    assert seen["verdict"] == CONTENTION and seen["readers"][0]["name"] == "dd", seen
    assert seen["baseline_source"].startswith("remembered: "), seen
    assert seen["latency_s"] > 3 * seen["baseline_latency_s"] and seen["agent_share"] < 0.25, seen


def test_another_process_writing_the_disk_hard_is_disk_contention_naming_the_writer(served, tmp_path):
    """dd rewriting 1 GiB of the big file with O_DIRECT 64 MiB writes, pass after pass: the agent's reads
    wait behind them; the disk verdict names dd and what it wrote."""
    db = served.agent.db
    quiet(db)
    disk_quiet(db)
    began = looped(f"dd if=/dev/zero of={served.big_file} bs=64M count=16 oflag=direct conv=notrunc", NEIGHBOUR_S,
                   tmp_path / "dd-write.log")
    verdict = diagnose(db, time.time() - began)
    assert_not_the_agents(verdict)
    seen = disk(verdict, "O_DIRECT writer")
    assert seen["verdict"] == CONTENTION and seen["readers"][0]["name"] == "dd", seen
    assert seen["others_write_bytes_per_s"] > 4 * seen["others_read_bytes_per_s"], seen
    assert seen["readers"][0]["write_bytes_per_s"] > disk_diagnosis.OTHERS_FLOOR, seen
    assert "wrote" in seen["summary"] and seen["latency_s"] > 3 * seen["baseline_latency_s"], seen


def test_another_process_appending_to_its_log_with_fsync_is_no_alarm(served, tmp_path):
    """A process appending 256 KiB to its log and syncing it ten times a second, as a database does: the disk
    writes for it all along, and neither verdict blames anything it did not slow."""
    db = served.agent.db
    quiet(db)
    log = tmp_path / "journal.log"
    began = looped(f"dd if=/dev/zero of={log} bs=256k count=1 oflag=append conv=notrunc,fsync 2>/dev/null; sleep 0.1",
                   NEIGHBOUR_S, tmp_path / "dd-journal.log")
    verdict = diagnose(db, time.time() - began)
    assert mean(db, f"io.{disk_diagnosis.agent_disk(db, began, time.time())}.others_write_bytes_per_s", began,
                time.time()) > 0
    assert_not_the_agents(verdict)
    assert_no_disk_alarm(verdict, "fsync'd log appends", ours="dd")
