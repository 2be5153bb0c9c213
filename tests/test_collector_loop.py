"""The collector on this machine: real samplers into a real store, sources coming and going,
and the `flashmoe-cli collect` process stopping cleanly on SIGTERM (and SIGHUP, but not under nohup)."""
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from collector import samplers
from collector.loop import Collector
from machine import proc_io
from store import queries
from store.db import Store
from store.errors import StoreError
from test_machine_proc_io import MAPPED

CLI = [sys.executable, "-m", "agent.cli"]


@pytest.fixture
def agent(tmp_path):
    """A stand-in agent process (any live process will do) and its pid file."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pid_file = tmp_path / "agent.pid"
    pid_file.write_text(f"{proc.pid}\n")
    yield proc, pid_file
    proc.kill()
    proc.wait()


def _points(db, name):
    """How many points of `name` the collector has stored so far (0 while it creates the file, whose
    lock a reader may wait out under load: StoreError "cannot read … yet")."""
    try:
        return len(queries.points(db, name)[0]) if db.exists() else 0
    except StoreError as e:
        if "yet" not in str(e):
            raise
        return 0


def test_a_pid_file_older_than_the_process_it_names_is_not_the_agent(tmp_path, agent):
    """A stale pid file (the agent killed, the box rebooted) whose pid a later process took: the collector
    sampled that process's memory as the agent's."""
    proc, pid_file = agent
    os.utime(pid_file, (time.time() - 3600, time.time() - 3600))
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        tick(Collector(store, pid_file), 0)
        assert "mem.agent.rss_bytes" not in queries.series_names(db)
        assert any("agent is not running" in e["message"] for e in queries.events(db))


def tick(collector, k):
    return collector.tick(1_700_000_000.0 + k, time.monotonic())


def test_ticks_sample_every_source_and_report_a_missing_one_once(tmp_path, agent):
    proc, pid_file = agent
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        collector = Collector(store, pid_file, store_path=tmp_path)
        for k in range(3):
            time.sleep(0.05)
            tick(collector, k)
        names = set(queries.series_names(db))
        disk = next(e for e in queries.events(db, kind="collector.expert_store"))
        assert str(tmp_path) in disk["message"]
        for name in ("mem.available_bytes", "mem.agent.rss_bytes", "mem.agent.minflt_per_s",
                     "vm.pgmajfault_per_s", "psi.memory.some_avg10", "psi.io.full_total_us",
                     "collector.cpu_fraction"):
            assert name in names
        assert any(n.startswith("block.") and n.endswith(".util") for n in names)
        rss = queries.latest(db, "mem.agent.rss_bytes")[1]
        status = Path(f"/proc/{proc.pid}/status").read_text()
        vm_rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        assert abs(rss - vm_rss_kb * 1024) < 1 << 20

        proc.kill()
        proc.wait()
        for k in range(3, 6):
            tick(collector, k)
        down = [e for e in queries.events(db) if "agent is not running" in e["message"]]
        assert len(down) == 1                                    # once per transition
        assert queries.latest(db, "mem.agent.rss_bytes")[0] == 1_700_000_002.0
        assert queries.latest(db, "mem.available_bytes")[0] == 1_700_000_005.0   # the rest goes on

        nvme_events = [e for e in queries.events(db, kind="collector.source_unavailable")
                       if "NVMe" in e["message"]]
        if not Path("/sys/class/nvme").exists():                 # this machine: virtio disk only
            assert len(nvme_events) == 1 and "no NVMe controller" in nvme_events[0]["message"]


def test_collect_command_stops_cleanly_on_sigterm_with_everything_flushed(tmp_path):
    db = tmp_path / "flashmoe.db"
    proc = subprocess.Popen(CLI + ["collect", "--db", str(db), "--interval", "0.2"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _points(db, "mem.free_bytes") >= 5:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "collector stopped; store flushed" in stderr
    t, _ = queries.points(db, "mem.free_bytes")
    assert len(t) >= 5
    assert np.allclose(np.round(t / 0.2), t / 0.2)              # stamped on the 0.2 s grid


def test_a_collector_started_under_nohup_outlives_a_hangup_and_still_stops_on_sigterm(tmp_path):
    """nohup (SIGHUP ignored from the start) asks a process to outlive its terminal: the collector's clean stop
    on SIGHUP must not undo that."""
    db = tmp_path / "flashmoe.db"
    proc = subprocess.Popen(CLI + ["collect", "--db", str(db), "--interval", "0.2"], stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _points(db, "mem.free_bytes") >= 2:
            time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)
        before = _points(db, "mem.free_bytes")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _points(db, "mem.free_bytes") < before + 3:
            time.sleep(0.1)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "collector stopped; store flushed" in stderr, stderr


def test_a_collector_at_a_limit_of_one_task_says_so_in_one_line(tmp_path, pids_cgroup):
    """It ended in a KeyboardInterrupt's traceback while importing numpy, below OpenBLAS's four lines: OpenBLAS
    raises SIGINT on a thread it cannot start."""
    (pids_cgroup / "pids.max").write_text("1")
    done = subprocess.run(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(pids_cgroup), *CLI, "collect",
                           "--db", str(tmp_path / "made" / "new.db"), "--duration", "1"],
                          capture_output=True, text=True, timeout=60)
    [line] = (done.stdout + done.stderr).splitlines()     # nothing else, OpenBLAS's lines neither
    assert done.returncode == 2 and " ERROR " in line, line
    assert line.endswith("flashmoe-cli collect cannot start: can't start new thread: the process is at its limit of "
                         "tasks (its cgroup's pids.max, systemd's TasksMax or ulimit -u); raise it, or stop other "
                         "processes under it"), line
    assert list(tmp_path.iterdir()) == []


def test_a_collector_reaching_its_task_limit_after_starting_says_so_in_one_line(tmp_path, pids_cgroup):
    """At two tasks the first check passes, numpy's OpenBLAS takes the second (two threads asked of it, whatever the
    cores), and the store's flusher thread then failed with a traceback."""
    (pids_cgroup / "pids.max").write_text("2")
    done = subprocess.run(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(pids_cgroup), *CLI, "collect",
                           "--db", str(tmp_path / "new.db"), "--duration", "1"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "OPENBLAS_NUM_THREADS": "2"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.rstrip().endswith("collect stopped: can't start new thread: the process is at its limit of "
                                         "tasks (its cgroup's pids.max, systemd's TasksMax or ulimit -u); raise it, or "
                                         "stop other processes under it"), done.stderr


def test_a_second_collector_on_a_store_is_refused_and_a_killed_ones_lock_is_freed(tmp_path):
    db = tmp_path / "flashmoe.db"
    first = subprocess.Popen(CLI + ["collect", "--db", str(db), "--interval", "0.2"],
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _points(db, "mem.free_bytes"):
            time.sleep(0.1)
        second = subprocess.run(CLI + ["collect", "--db", str(db), "--duration", "5"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr
        assert f"another collector is already writing {db}: one collector per store" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()                       # SIGKILL: the kernel frees its lock
        first.wait()
    third = subprocess.run(CLI + ["collect", "--db", str(db), "--duration", "0.5", "--interval", "0.1"],
                           capture_output=True, text=True, timeout=60)
    assert third.returncode == 0 and "collector stopped; store flushed" in third.stderr


def test_collect_refuses_bad_arguments_with_a_message(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"x" * 4096)
    result = subprocess.run(CLI + ["collect", "--db", str(junk), "--duration", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "junk.db as a FlashMoE store" in result.stderr
    result = subprocess.run(CLI + ["collect", "--db", str(tmp_path / "x.db"), "--interval", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--interval: must be a positive finite number" in result.stderr


def test_the_collector_and_store_commands_never_import_torch():
    code = ("import sys, collector.loop, store.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ticks_lie_on_the_grid_and_stop_when_asked():
    import threading

    from collector.loop import ticks
    stop = threading.Event()
    seen = []
    for t_wall, _, _ in ticks(0.05, stop, duration=None):
        seen.append(t_wall)
        if len(seen) == 5:
            stop.set()
    assert len(seen) == 5
    assert all(b > a for a, b in zip(seen, seen[1:]))
    assert np.allclose(np.round(np.array(seen) / 0.05), np.array(seen) / 0.05)


def test_every_tick_is_taken_or_counted_missed_when_the_loop_is_late():
    import threading

    from collector.loop import ticks
    stop = threading.Event()
    seen, missed = [], []
    for t_wall, _, m in ticks(0.05, stop, duration=None):
        seen.append(t_wall)
        missed.append(m)
        if len(seen) == 6:
            stop.set()
        elif len(seen) % 2:
            time.sleep(0.12)             # a tick whose work outlasts two intervals (e.g. a flush behind a thrash)
    assert all(m >= 2 for m in missed[1::2])
    assert len(seen) + sum(missed) == round((seen[-1] - seen[0]) / 0.05) + 1   # the grid, taken or counted


def test_missed_ticks_are_stored_with_the_next_sample(tmp_path):
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        collector = Collector(store)
        for k, missed in enumerate([0, 3, 0, 2]):
            collector.tick(1_700_000_000.0 + k, time.monotonic(), missed)
    assert queries.missed_samples(db) == 5
    assert queries.missed_samples(db, 1_700_000_002.0, 1_700_000_003.0) == 2


def test_a_hotplug_event_is_recorded_and_devices_rediscovered(tmp_path):
    db = tmp_path / "flashmoe.db"
    with Store(db, autoflush_s=0) as store:
        collector = Collector(store)
        assert collector.hotplug is not None
        device = sorted(p.name for p in Path("/sys/block").iterdir())[0]
        Path(f"/sys/block/{device}/uevent").write_text("change")     # a real kernel uevent
        expected = f"change block device {device}"
        deadline = time.monotonic() + 10
        k = 0
        while time.monotonic() < deadline:
            tick(collector, k)
            k += 1
            if expected in [e["message"] for e in queries.events(db, kind="device.hotplug")]:
                break
            time.sleep(0.05)
        assert expected in [e["message"] for e in queries.events(db, kind="device.hotplug")]
        assert len(queries.events(db, kind="collector.devices")) >= 2     # rediscovered


def test_the_collector_waits_for_a_locked_store_instead_of_exiting(tmp_path, caplog):
    import sqlite3
    import threading

    from collector.loop import open_store
    db = tmp_path / "flashmoe.db"
    Store(db, autoflush_s=0).close()
    blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")                         # a real second writer holds the lock
    release = threading.Timer(3.0, blocker.execute, args=("ROLLBACK",))
    give_up = threading.Event()
    safety = threading.Timer(60.0, give_up.set)
    release.start()
    safety.start()
    try:
        store = open_store(db, give_up, retry_s=0.2)
    finally:
        release.join()
        safety.cancel()
        blocker.close()
    assert store is not None
    store.close()
    assert "database is locked" in caplog.text and "retrying" in caplog.text


def test_nvme_without_admin_access_falls_back_to_hwmon_and_says_so_once(tmp_path):
    from collector.samplers import NvmeSampler
    from collector.status import SourceStatus
    from machine.devices import NvmeController
    (tmp_path / "hwmon0").mkdir()
    (tmp_path / "hwmon0" / "temp1_input").write_text("38000\n")
    events = []
    sampler = NvmeSampler(NvmeController("nvme0", "/dev/null", tmp_path, "Test SSD", "S1", "1.0"),
                          SourceStatus(lambda kind, message: events.append((kind, message))))
    for _ in range(3):
        assert sampler.sample(0.0) == {"nvme.nvme0.temperature_c": 38.0}
    [(kind, message)] = events
    assert kind == "collector.source_unavailable"
    assert "Get Log Page 02h on /dev/null failed" in message and "falling back to the hwmon" in message


@pytest.mark.parametrize("flag", ["--interval", "--duration", "--retention-days"])
@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-1"])
def test_collect_refuses_a_number_that_is_not_positive_and_finite(tmp_path, flag, value):
    result = subprocess.run(CLI + ["collect", "--db", str(tmp_path / "x.db"), f"{flag}={value}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{flag}: must be a positive finite number" in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["1e-300", "0.001"])
def test_collect_refuses_an_interval_shorter_than_its_ticks_can_be(tmp_path, value):
    """1e-300 overflowed the tick grid (ceil(now / interval)): an OverflowError traceback."""
    result = subprocess.run(CLI + ["collect", "--db", str(tmp_path / "x.db"), f"--interval={value}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--interval: must be at least 0.01 s" in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())


def collected_beside(tmp_path: Path, neighbour: list[str]) -> tuple[Path, str, int]:
    """Eight collector ticks of a stand-in agent reading its 64 MiB file with O_DIRECT while `neighbour`
    (a command in its own session, output to a log on the same disk) runs; the store, the disk and the
    neighbour's pid."""
    ours = tmp_path / "experts.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={ours}", "bs=1M", "count=64", "conv=fsync"], check=True,
                   capture_output=True)
    agent = subprocess.Popen([sys.executable, "-c", f"""
import mmap, os, time
fd, buf = os.open({str(ours)!r}, os.O_RDONLY | os.O_DIRECT), mmap.mmap(-1, 1 << 20)
while True:
    for off in range(0, 64 << 20, 1 << 20):
        os.preadv(fd, [buf], off)
        time.sleep(0.01)
"""])
    with (tmp_path / "neighbour.log").open("w") as log:
        other = subprocess.Popen(neighbour, stdout=log, stderr=log, start_new_session=True)
    pid_file = tmp_path / "agent.pid"
    pid_file.write_text(f"{agent.pid}\n")
    db = tmp_path / "flashmoe.db"
    try:
        wait_for_direct = time.monotonic() + 30
        while proc_io.direct_io_disk(agent.pid) is None and time.monotonic() < wait_for_direct:
            time.sleep(0.1)
        with Store(db, autoflush_s=0) as store:
            collector = Collector(store, pid_file)
            for k in range(8):
                time.sleep(0.5)
                tick(collector, k)
    finally:
        os.killpg(other.pid, signal.SIGKILL)          # the neighbour and its children
        agent.kill()
        other.wait(), agent.wait()
    disk = proc_io.disk_of(os.stat(ours).st_dev)
    assert collector.readers.disk == disk
    return db, disk, other.pid


def named(db: Path, disk: str, by: str = "name") -> dict[str | int, tuple[float, float]]:
    """The most each named process read and wrote per second (disk_readers rows), by name or pid."""
    with sqlite3.connect(db) as conn:
        return {who: (read, write) for who, read, write in conn.execute(
            f"SELECT {by}, MAX(read_bytes_per_s), MAX(write_bytes_per_s) FROM disk_readers WHERE device = ? "
            f"GROUP BY {by}", (disk,))}


def test_the_agents_disk_reads_are_split_and_the_other_reader_is_named_not_the_shell_reaping_it(tmp_path):
    """A shell running `dd` O_DIRECT reads of another file on the agent's disk, one after another (the shell
    is charged each dd's read_bytes as it reaps it, proc(5), but has its log open for writing only): the
    collector finds the agent's disk by its O_DIRECT file, splits the disk's reads, and names dd."""
    theirs = tmp_path / "other.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={theirs}", "bs=1M", "count=64", "conv=fsync"], check=True,
                   capture_output=True)
    loop = f"while :; do dd if={theirs} of=/dev/null bs=1M iflag=direct; done"
    db, disk, _ = collected_beside(tmp_path, ["sh", "-c", loop])
    others = queries.points(db, f"io.{disk}.others_read_bytes_per_s")[1]
    mine = queries.points(db, f"io.{disk}.agent_read_bytes_per_s")[1]
    assert others.max() > samplers.READER_FLOOR and mine.max() > 0
    names = named(db, disk)
    assert "dd" in names and "sh" not in names, names


def test_whether_a_reader_has_a_file_on_the_agents_disk_is_looked_at_again(monkeypatch):
    """A process first looked at while it read another disk was never named once it read the agent's, for as
    long as others kept reading the agent's disk (a way to hide from the disk verdict); a reused pid likewise
    kept its first process's answer. /proc stands in for one function's test: its reads, its open files."""
    reads, opened = {4242: 0}, {4242: False}
    monkeypatch.setattr(proc_io, "all_io_bytes", lambda: {pid: proc_io.Io(n, 0) for pid, n in reads.items()})
    monkeypatch.setattr(proc_io, "own_io_bytes", lambda pid: proc_io.Io(reads[pid], 0))
    monkeypatch.setattr(proc_io, "use_of", lambda pid, disk: proc_io.Use(opened[pid], False))
    monkeypatch.setattr(proc_io, "process_name", lambda pid: "reader")
    sampler, tops = samplers.DiskReadersSampler(None), []
    for t in range(3 * int(samplers.LOOK_AGAIN_S)):
        reads[4242] += 100 << 20                  # 100 MiB/s, of another disk until t = 5, then of the agent's
        opened[4242] = t >= 5
        tops.append(sampler._users(agent=1, disk="vda", t=float(t), device=proc_io.Io(200 << 20, 0)))
    assert tops[1:6] == [[]] * 5 and tops[-1] == [(4242, "reader", 100 << 20, 0.0)]


def test_another_process_writing_the_agents_disk_is_counted_and_named_with_its_writes(tmp_path):
    """One `dd` writing a file on the agent's disk with O_DIRECT: the disk's writes for others are counted
    beside its reads, and dd is named with what it wrote."""
    db, disk, _ = collected_beside(tmp_path, ["dd", "if=/dev/zero", f"of={tmp_path / 'written.bin'}", "bs=4M",
                                              "count=100000", "oflag=direct"])
    writes = queries.points(db, f"io.{disk}.others_write_bytes_per_s")[1]
    assert writes.max() > samplers.READER_FLOOR, writes
    names = named(db, disk)
    assert "dd" in names and names["dd"][1] > samplers.READER_FLOOR, names



def test_a_shell_reaping_writer_after_writer_is_not_named_for_their_writes(tmp_path):
    """A shell running short `dd` O_DIRECT writers one after another, its log open for writing on the same
    disk: it is charged each dd's write_bytes as it reaps it, smoothly enough to pass for a writer; only
    the dd processes, whose own threads wrote, are named."""
    db, disk, _ = collected_beside(tmp_path, ["sh", "-c", f"while :; do dd if=/dev/zero of={tmp_path / 'w.bin'} "
                                                          f"bs=4M count=16 oflag=direct conv=notrunc; done"])
    names = named(db, disk)
    assert "dd" in names and "sh" not in names, names

MAPPED_READER = MAPPED + """
pages, address, size = mapped(sys.argv[1])
while True:
    read_pages(pages)
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_DONTNEED)   # unmapped, then dropped
    fd = os.open(sys.argv[1], os.O_RDONLY)                       # from the page cache: the next pass reads the disk
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
"""


def test_a_process_reading_the_agents_disk_through_a_mapping_it_holds_no_descriptor_of_is_named(tmp_path):
    """Its page faults' reads are its read_bytes; its mapping of a data file on the disk names it."""
    theirs = tmp_path / "weights.bin"
    subprocess.run(["dd", "if=/dev/urandom", f"of={theirs}", "bs=1M", "count=64", "conv=fsync"], check=True,
                   capture_output=True)
    db, disk, pid = collected_beside(tmp_path, [sys.executable, "-c", MAPPED_READER, str(theirs)])
    pids = named(db, disk, by="pid")
    assert pid in pids and pids[pid][0] > samplers.READER_FLOOR, pids
