"""Whether this process may start one more task (thread): at its limit, the kernel refuses with EAGAIN, and all
Python says of it is THREAD_REFUSED; each command of ours says AT_TASK_LIMIT instead."""
from __future__ import annotations

import threading

THREAD_REFUSED = "can't start new thread"
AT_TASK_LIMIT = ("the process is at its limit of tasks (its cgroup's pids.max, systemd's TasksMax or ulimit -u); "
                 "raise it, or stop other processes under it")


def check_below_task_limit() -> None:
    """RuntimeError(THREAD_REFUSED) if the process may not start one more task. At a limit of one (the main
    thread alone) libraries fail before our own threads, and none says the limit: numpy's OpenBLAS prints four
    lines and raises SIGINT (a KeyboardInterrupt's traceback), pyudev's lookup of libudev runs ldconfig in a
    child process whose refusal ctypes keeps to itself ("No library named udev"), and torch's OpenMP aborts the
    process on a thread it cannot create."""
    probe = threading.Thread(target=lambda: None)
    probe.start()
    probe.join()
