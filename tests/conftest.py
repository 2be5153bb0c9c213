"""Suite-wide settings and fixtures."""
import contextlib
import http.server
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agents import kill_agents_serving, wait_for
from hypothesis import settings

# No timing assertions in tests: Hypothesis's 200 ms deadline fails property tests on a loaded CI machine.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# A suite run under nohup would pass SIGHUP's ignored disposition on to every agent, collector and command it
# starts, and those outlive a hangup as nohup asks, so the tests that hang them up would fail. A handler that
# does nothing keeps the suite itself ignoring hangups, and exec resets a handler (not SIG_IGN) to the default.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)


@contextlib.contextmanager
def answering(content_type: str, body: bytes) -> Iterator[str]:
    """A loopback HTTP server that answers every GET, PUT and POST with `body`; its URL."""
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body)

        do_PUT = do_POST = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture
def html_server() -> Iterator[str]:
    """Every request answered with an HTML page, as the dashboard's own port does: an address set to the wrong
    port."""
    with answering("text/html", b"<!doctype html><div id=root></div>") as url:
        yield url


@pytest.fixture
def hostile_target() -> Iterator[tuple[str, list[int]]]:
    """A loopback server answering /v1/status a byte every 0.1 s and anything else (GET or POST) with 64 MiB at full
    speed, as a Fleet target or another service at the agent's address may; yields its address and how many bytes
    it sent at full speed."""
    sent = [0]
    stopping = threading.Event()

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            try:
                while not stopping.is_set() and sent[0] < 64 << 20:
                    if self.path.startswith("/v1/status"):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        stopping.wait(0.1)
                    else:
                        self.wfile.write(b" " * 65536)
                        sent[0] += 65536
            except OSError:        # the client closed the connection
                pass

        do_POST = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sent
    finally:
        stopping.set()
        server.shutdown()


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[..., Path]]:
    """mount(size, inodes) mounts a tmpfs of that size (a small real disk; with `inodes`, that many files and
    directories, its root included) and returns its directory; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "disk"
    point.mkdir()

    def mount(size: str = "4m", inodes: int | None = None) -> Path:
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=True)
        return point
    yield mount
    subprocess.run(["umount", "-l", str(point)], capture_output=True)



@pytest.fixture(autouse=True, scope="module")
def no_agent_left_running(tmp_path_factory) -> Iterator[None]:
    """By a module's end every agent its tests started (a `serve` of a model under this run's temporary
    directory) has stopped: one left running would serve on beside later tests and be counted by those that
    look for agents. One left is killed, and the module fails with what it was."""
    yield
    left = kill_agents_serving(tmp_path_factory.getbasetemp())
    assert not left, f"agents left running by this module's tests (killed): {left}"


PIDS = Path("/sys/fs/cgroup/pids")    # cgroup v1's pids controller, as this machine and CI mount it


@pytest.fixture
def pids_cgroup():
    """A pids cgroup of the test's own, removed once its processes are gone."""
    if not os.access(PIDS, os.W_OK):
        pytest.skip(f"needs a writable pids cgroup at {PIDS} (root, cgroup v1)")
    group = PIDS / f"flashmoe-test-{os.getpid()}"
    group.mkdir()
    yield group
    wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 30, f"{group} to empty")
    group.rmdir()


@pytest.fixture
def json_server() -> Iterator[str]:
    """Every request answered with the JSON object {"x": 1}, as a JSON service that is not our agent does: an
    address set to another service."""
    with answering("application/json", b'{"x": 1}') as url:
        yield url
