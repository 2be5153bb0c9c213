"""This machine's name in a fleet: the device_name label of everything the agent and the collector
export, and the device a telemetry store belongs to."""
from __future__ import annotations

import argparse
import re
import socket

DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


def device_name(text: str) -> str:
    """--device-name: a name that fits a Prometheus label, a URL and a log line as it is."""
    if not DEVICE_NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device name: use 1-63 letters, digits, '.', '_' "
                                         f"or '-', starting with a letter or digit")
    return text


def add_device_name(parser: argparse.ArgumentParser, what: str) -> None:
    """The --device-name option (default: the host name), described for `what` the command exports."""
    parser.add_argument("--device-name", type=device_name, default=socket.gethostname(),
                        help=f"this device's name in the fleet: the device_name label of {what}, and the device "
                             f"the --db store belongs to (default: the host name)")
