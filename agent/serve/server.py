"""flashmoe-cli serve: run the agent (completions, knobs, status, metrics over HTTP).

Examples:
    flashmoe-cli serve --model data/demo --db data/flashmoe.db --pid-file data/agent.pid
    flashmoe-cli serve --model data/demo --cache-cap 25% --policy flashmoe --backend direct --port 8600
    flashmoe-cli serve --model data/demo --device-name edge-01 --port 8600
    FLASHMOE_TOKEN=$(openssl rand -hex 16) flashmoe-cli serve --model data/demo --host 0.0.0.0
    flashmoe-cli serve --model data/demo --verify --max-prompt-bytes 32768

Loopback only by default. Binding any other address needs a token (FLASHMOE_TOKEN or --token-file):
control calls (PUT /v1/knobs, POST /v1/cache/preload) must then send `Authorization: Bearer TOKEN`
(at least 16 characters). After 5 wrong tokens from one address, each further one locks that address
out of control calls (HTTP 429) for twice as long as the last, up to 60 s.
/metrics labels every series device_name=NAME (--device-name, default this host's name), so a
fleet's Prometheus tells devices apart by name. The port is bound before the model loads, so a busy
port fails at once; the --db store is opened (made, if new) only once the model has loaded and every
option has been checked, so an agent that cannot start leaves no new store behind; one that fails after
(a thread the process may not start) removes the store it made, and the directories it made for it, unless
another process has opened it meanwhile; a store or directory that was there before is kept whatever
happens. SIGTERM, Ctrl-C or SIGHUP (its terminal closed; not under nohup) stops within a step: open streams
end with an error event saying so (OpenAI's clients raise it) and [DONE], other open completions with HTTP
503 and Retry-After, the last statistics are written, the pid file is removed, and the process exits at
once (a process manager such as honcho kills it 5 s after its SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from access.loopback import is_loopback
from agent.argtypes import add_dense, add_int8_activations, add_prefetch, count, port, threads
from agent.atomic_file import write_atomically
from agent.experts.cap import KV_BUDGET_TOKENS
from agent.experts.layout import StoreError as ExpertStoreError
from agent.experts.reader import BACKENDS, IO_THREADS
from agent.serve.limits import BODY_BYTES_PER_PROMPT_BYTE, MAX_PROMPT_BYTES
from agent.serve.scheduler import ADMIT_WINDOW_S, MAX_WAITING
from agent.token_option import TOKEN_ENV, TokenError, add_token_arguments, token_from
from machine.identity import add_device_name
from machine.memory import read_pid_file
from machine.stop_signals import stop_signals
from machine.task_limit import AT_TASK_LIMIT, THREAD_REFUSED, check_below_task_limit
from store.database import missing_parents, remove_empty

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class ServeError(Exception):
    """The agent cannot start; the message says what to change."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--model", required=True, type=Path,
                   help="expert store directory (flashmoe-cli convert / init-demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; others need a token)")
    p.add_argument("--port", type=port, default=8600, help="TCP port (default 8600; 0 picks a free one)")
    p.add_argument("--db", type=Path,
                   help="telemetry store to write statistics and knob changes to, and restore knobs from")
    p.add_argument("--pid-file", type=Path, help="write the agent's pid here (the collector finds the agent by it)")
    add_token_arguments(p, "bearer token control calls must carry")
    add_device_name(p, "every /metrics series")
    p.add_argument("--cache-cap", help="expert cache cap: bytes, a size (2GiB) or a share of expert bytes (25%%)")
    p.add_argument("--policy", help="replacement policy (lru, flashmoe, ...)")
    p.add_argument("--backend", choices=BACKENDS, default="direct", help="expert reads: O_DIRECT, buffered or mmap")
    p.add_argument("--max-batch-size", type=int, help="most requests sharing one decode step (default 16)")
    p.add_argument("--max-waiting", type=count, default=MAX_WAITING,
                   help=f"most requests queued for a place in the batch; more get HTTP 429 (default {MAX_WAITING})")
    p.add_argument("--kv-budget", type=count, default=KV_BUDGET_TOKENS, metavar="POSITIONS",
                   help="KV cache positions (prompt + max_tokens) of all running requests together: the cache cap's "
                        "memory rule counts them, a request waits while they would overflow, and one larger than "
                        f"the whole budget is refused (default {KV_BUDGET_TOKENS})")
    p.add_argument("--threads", type=threads, default=1, help="torch intra-op threads for the model step (default 1: "
                   "reads run on other threads, and on a small CPU more threads busy-wait against them)")
    p.add_argument("--prefill-threads", type=threads, help="torch intra-op threads for a step that admits prompts "
                   "(default: --threads; its matmuls are large enough to split, where a core is free for them)")
    p.add_argument("--workers", type=threads, default=1, help="threads a step computes on, the model's own one of "
                   "them: its experts are handed out whole to whichever is free (default 1)")
    p.add_argument("--io-threads", type=threads, default=IO_THREADS, help=f"expert reads in flight at once (default "
                   f"{IO_THREADS}: an SSD reaches its bandwidth only with several requests queued)")
    p.add_argument("--admit-window-ms", type=float, default=ADMIT_WINDOW_S * 1000,
                   help=f"when idle, wait this long after a request arrives so a burst shares its first step "
                        f"(default {ADMIT_WINDOW_S * 1000:g}; 0 steps at once)")
    add_prefetch(p, None)     # None: the stored knobs' mode, else auto
    p.add_argument("--route-trace", type=Path, nargs="+", default=(), metavar="FILE",
                   help="take each token's experts from recorded real routing (../shared/traces), for a random-weight "
                        "model; each request follows the trace from a place its prompt decides")
    add_int8_activations(p)
    add_dense(p)
    p.add_argument("--verify", action="store_true", help="check every expert block's CRC32 in the background "
                   "while idle; GET /v1/status reports progress and damaged blocks under \"store\"")
    p.add_argument("--max-prompt-bytes", type=count, default=MAX_PROMPT_BYTES,
                   help=f"refuse a text prompt longer than this before tokenizing it (default {MAX_PROMPT_BYTES}); "
                        f"request bodies may be {BODY_BYTES_PER_PROMPT_BYTE}x this")


def check_host(host: str) -> None:
    """An address to bind: an IP address, or a name this box resolves (localhost)."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if host.replace(".", "").isdigit():   # 999.1.1.1: meant as an address (no host name is all digits)
        raise ServeError(f"--host {host} is not an IP address: an IPv4 address is four numbers of 0 to 255; give "
                         f"e.g. 127.0.0.1 (this box only) or 0.0.0.0 (every interface)")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a host name"
        raise ServeError(f"--host {host} is neither an IP address nor a name this box resolves ({reason}); give "
                         f"e.g. 127.0.0.1 (this box only) or 0.0.0.0 (every interface)") from None


def check_token(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise ServeError(f"refusing to bind {host}: it is not a loopback address, so control calls need a token; "
                         f"set {TOKEN_ENV} or pass --token-file FILE, or bind 127.0.0.1")
    if token and len(token) < MIN_TOKEN_CHARS:   # each address gets a few guesses a minute (access/guesses.py)
        raise ServeError(f"the token (--token, --token-file or {TOKEN_ENV}) is {len(token)} characters; give at "
                         f"least {MIN_TOKEN_CHARS}, e.g. one from `openssl rand -hex 16`")
    if token and not (token.isascii() and token.isprintable() and token == token.strip()):
        # A client's header cannot carry it as given (HTTP strips the ends; no control or non-ASCII
        # characters): an agent no caller could ever unlock
        raise ServeError("the token must be printable ASCII with no space at either end, as an HTTP header carries "
                         f"it; the one given (--token, --token-file or {TOKEN_ENV}, {len(token)} characters) is not")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = {errno.EADDRINUSE: "pass another --port",
                errno.EADDRNOTAVAIL: "no interface of this box has that address; give one it has, 0.0.0.0 for "
                                     "every interface or 127.0.0.1"}.get(exc.errno, "check --host")
        raise ServeError(f"cannot bind {host}:{port}: {exc.strerror}; {hint}") from None
    sock.listen(128)
    return sock


def claim_pid_file(path: Path) -> None:
    """Write our pid; refuse if the file names another live process (a second agent), or holds something
    other than a pid (a mistyped --pid-file, e.g. the store's path, would be overwritten and then removed)."""
    other = read_pid_file(path)
    if other and other != os.getpid():
        raise ServeError(f"{path} names a running process ({other}): another agent is up; stop it or pass another "
                         f"--pid-file")
    if not _is_pid_file(path):
        raise ServeError(f"--pid-file {path} exists and is not a pid file (it holds something other than a process "
                         f"id); it would be overwritten, so it is left as it is: pass another --pid-file")
    try:
        write_atomically(path, lambda tmp: tmp.write_text(f"{os.getpid()}\n"), "the pid file", "--pid-file")
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def _is_pid_file(path: Path) -> bool:
    """No file (a directory fails the write, with its reason), an empty one, or one holding a process id alone
    (a stale pid file): ours to write."""
    if not path.is_file():
        return True
    try:
        text = path.read_text().strip() if path.stat().st_size <= 32 else "too long"
    except (OSError, UnicodeDecodeError):
        return False
    return text == "" or text.isdigit()


def release_pid_file(path: Path) -> None:
    try:
        if int(path.read_text().strip()) == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass  # not ours, gone, or never written (claim_pid_file failed)


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """The telemetry store's errors, said as the agent's."""
    from store.errors import StoreError
    try:
        yield
    except StoreError as exc:
        raise ServeError(str(exc)) from None


def open_store(path: Path, device_name: str):
    """The telemetry store at `path`, created if there is none."""
    from store.db import Store
    with store_errors():
        return Store(path, device_name=device_name)


def remove_new_store(path: Path, made_dirs: list[Path]) -> None:
    """The store this run made, and the directories it made for it, for an agent that never served: removed,
    unless another process opened the store."""
    from store.database import remove_unshared
    if path.exists():   # not if making it failed: store.database removed what it had written
        if not remove_unshared(path):
            log.warning("kept the store %s this run made, though the agent did not start: another process may "
                        "have opened it (the collector, a reader)", path)
            return
        log.info("removed the store %s this run made: the agent did not start", path)
    remove_empty(made_dirs)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a caught SIGTERM after its shutdown, which would kill us before the runtime
        stops, the last statistics are written and the pid file is removed; here a signal only stops.
        Its shutdown first runs `on_shutdown` (ending the running requests), so it does not wait out its
        graceful timeout on responses that would stream for minutes."""

        def __init__(self, config: uvicorn.Config, on_shutdown) -> None:
            super().__init__(config)
            self.on_shutdown = on_shutdown

        async def shutdown(self, sockets=None) -> None:
            self.on_shutdown()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in stop_signals()}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def run(args: argparse.Namespace) -> int:
    try:
        serve(args)
    except ServeError as exc:
        log.error("%s", exc)
        return 2
    _exit_now()


def _exit_now() -> NoReturn:
    """End the stopped agent's process without Python's finalization: everything is closed and written by
    now, and garbage-collecting torch's and numba's modules took seconds more after "agent stopped"."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from agent.serve.app import create_app
    from agent.serve.request_deadline import RequestDeadline
    from agent.serve.runtime import Runtime, ServeOptions
    from agent.tokenizer import load_tokenizer

    try:
        token = token_from(args)
    except TokenError as exc:
        raise ServeError(str(exc)) from None
    check_host(args.host)
    check_token(args.host, token)
    if not args.model.is_dir():
        raise ServeError(f"--model {args.model} is not a directory; create one with flashmoe-cli init-demo or convert")
    if args.db:   # now, not after the model loaded (the store itself is opened last)
        from store.database import check_place
        with store_errors():
            check_place(args.db)
    sock = bind(args.host, args.port)
    store = runtime = None
    made_store = serving = False
    made_dirs: list[Path] = []
    pid_dirs = missing_parents(args.pid_file) if args.pid_file else []
    try:
        if args.pid_file:
            claim_pid_file(args.pid_file)
        try:
            check_below_task_limit()   # before the model loads: the first to fail at a limit of one is a library
            opts = ServeOptions(args.model, args.cache_cap, args.policy, args.backend, args.prefetch,
                                args.max_batch_size, args.threads, args.io_threads, args.admit_window_ms / 1000,
                                args.verify, tuple(args.route_trace), args.prefill_threads, args.int8_activations,
                                args.max_waiting, args.kv_budget, args.dense, args.workers)
            runtime = Runtime(opts, CollectorRegistry())
            tokenizer = load_tokenizer(args.model)
            if args.db:   # last: no store for a failed start, but its own threads and start() still may fail
                made_store, made_dirs = not args.db.exists(), missing_parents(args.db)
                store = open_store(args.db, args.device_name)
            with store_errors():   # start() restores the knobs the store holds
                runtime.start(store)
        except (ValueError, OSError, ExpertStoreError) as exc:
            raise ServeError(f"cannot start the agent: {exc}") from None
        except RuntimeError as exc:   # the probe above, the store's flusher, the scheduler or the ticker thread
            if str(exc) != THREAD_REFUSED:
                raise
            raise ServeError(f"cannot start the agent: {exc}: {AT_TASK_LIMIT}") from None
        app = create_app(runtime, tokenizer, args.device_name, token, args.max_prompt_bytes)
        host, port = sock.getsockname()[:2]
        log.info("agent %s serving %s on http://%s:%d (token %s)", args.device_name, args.model, host, port,
                 "required" if token else "off")
        # proxy_headers off: uvicorn took a client's address from X-Forwarded-For on any connection from loopback,
        # so a local process, or a client through a proxy on the box, named a new address on every wrong token
        config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=10, http=RequestDeadline,
                                proxy_headers=False)
        serving = True
        _server_class()(config, app.state.stop_serving).run(sockets=[sock])
    finally:
        if runtime is not None:
            runtime.stop()
        if store is not None:
            store.close()
        if made_store and not serving:
            remove_new_store(args.db, made_dirs)
        if args.pid_file:
            release_pid_file(args.pid_file)
            if not serving:   # a failed start leaves none of the directories it made (supervise tries again)
                remove_empty(pid_dirs)
        sock.close()
        log.info("agent stopped")
