"""flashmoe-cli: one console script, one subcommand per library entry point.

Each command lives in the module named below, which defines `add_arguments(parser)` and
`run(args) -> int`. Only the chosen command's module is imported, so `collect` never loads torch.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
from pathlib import Path

from agent.argtypes import refuse_empty_paths
from machine.stop_signals import stop_signals
from machine.task_limit import AT_TASK_LIMIT, THREAD_REFUSED, check_below_task_limit

COMMANDS = {
    "convert": ("agent.convert", "convert a Hugging Face MoE checkpoint into an expert store"),
    "init-demo": ("agent.demo", "write the random-weight OLMoE-shaped demo model (idempotent)"),
    "generate": ("agent.generate", "generate tokens with experts streamed from the SSD"),
    "simulate": ("agent.simulator", "replay routing traces through the cache policies"),
    "train-policy": ("agent.learned.train", "train the learned FlashMoE policy by imitating Belady"),
    "serve": ("agent.serve.server", "run the agent: completions, knobs, status and metrics over HTTP"),
    "supervise": ("agent.supervise", "run the agent and start it again when it dies, with a backoff"),
    "traffic": ("agent.traffic", "send demo completions to the agent from a few clients"),
    "warmup": ("agent.warmup", "find the hot experts of a prompt file and preload them into the agent"),
    "collect": ("collector.loop", "sample the SSD, block devices and memory into the store"),
    "store": ("store.cli", "inspect the telemetry store: stats, export"),
    "diagnose": ("store.diagnosis", "memory-thrash verdict from the store: the evidence and the fix"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmoe-cli", description="FlashMoE: MoE inference with experts on the SSD and a learned RAM cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--warmup", type=Path, metavar="FILE", help="shorthand for `flashmoe-cli warmup FILE`")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    refuse_empty_paths(parser)
    return parser


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the command runs as Ctrl-C's KeyboardInterrupt is, so that it ends as it
    does for Ctrl-C: the default action ended it on the spot, and `convert` or `init-demo` left its partial
    directory (gigabytes, hidden beside the destination) when its SSH session closed. serve, collect and
    supervise put their own clean stop in place of this."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, _frame) -> None:
    for other in stop_signals():     # a second one (a hangup, then honcho's or systemd's SIGTERM) must not cut
        if other != signal.SIGINT:   # the clean-up short; Ctrl-C twice still does, as it always has
            signal.signal(other, signal.SIG_IGN)
    raise Stopped(signum)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
INTERRUPTED = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP: its terminal closed"}


def at_task_limit(command: str | None) -> int:
    """2, said in one line, if the process may not start a thread; else 0. Checked before the command's module
    is imported: at a limit of one task, numpy's import ended `collect` in a KeyboardInterrupt's traceback below
    OpenBLAS's four lines (it raises SIGINT on a thread it cannot start)."""
    try:
        check_below_task_limit()
    except RuntimeError as exc:
        logging.basicConfig(format=LOG_FORMAT)
        name = "flashmoe-cli" + (f" {command}" if command else "")
        logging.getLogger("agent.cli").error("%s cannot start: %s: %s", name, exc, AT_TASK_LIMIT)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--warmup" in argv and not any(a in COMMANDS for a in argv):
        i = argv.index("--warmup")
        argv = argv[:i] + ["warmup"] + argv[i + 1:]
    command = next((a for a in argv if a in COMMANDS), None)
    if unstartable := at_task_limit(command):
        return unstartable
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT)
    if not args.verbose:   # httpx logs every request at INFO: `traffic` drowned the demo's output in them
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.command:
        build_parser(None).print_help()
        return 2
    for signum in stop_signals():
        if signum != signal.SIGINT:            # Python raises KeyboardInterrupt for it already
            signal.signal(signum, _stop)
    try:
        code = importlib.import_module(COMMANDS[args.command][0]).run(args)
        sys.stdout.flush()   # here, where a failure is caught, not at exit
        return code
    except BrokenPipeError:     # `... | head` stopped reading: stop writing, as cat does, without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # for the flush at exit
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # a full disk under output the command does not write itself (`... > file`, mostly): say it, not a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # for the flush at exit, which would fail too
        logging.getLogger("agent.cli").error("%s stopped: the disk is full (%s) writing %s; what it wrote there is "
                                             "incomplete", args.command, exc.strerror, exc.filename or "its output")
        return 1
    except RuntimeError as exc:
        if str(exc) != THREAD_REFUSED:
            raise
        # the limit reached after the first check: numpy's OpenBLAS took the last task, and a thread of ours failed
        logging.getLogger("agent.cli").error("%s stopped: %s: %s", args.command, exc, AT_TASK_LIMIT)
        return 2
    except KeyboardInterrupt as exc:   # Ctrl-C or Stopped: the commands write their outputs whole or not at all
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        logging.getLogger("agent.cli").error("%s interrupted (%s) before it finished; run it again", args.command,
                                             INTERRUPTED[signum])
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
