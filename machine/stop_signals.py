"""The signals that ask a long-running process of ours (the agent, the collector, the supervisor) to stop
cleanly: what it holds is then written and counted, where the default action of any of them ends the
process on the spot."""
from __future__ import annotations

import signal


def stop_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM (kill, honcho, systemd), SIGINT (Ctrl-C) and SIGHUP (the terminal or SSH session it runs in
    closed), unless SIGHUP is ignored, as `nohup` starts a process to outlive its terminal."""
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return signal.SIGTERM, signal.SIGINT, *hangup
