"""Loopback addresses and names, and the Host header that names one.

A service bound to loopback is reached only from the box itself. A web page can reach it as well,
from the browser of someone on the box, under its own host name re-pointed at 127.0.0.1 (DNS
rebinding): the browser then deems the service the page's own origin and lets it send any request.
Such a request still names the page's host in its `Host` header, so what is open on loopback is
open only to requests addressed to a loopback host.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str | None) -> bool:
    """Whether `host` (an address or "localhost") is loopback; None (bound to every interface) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "0.0.0.0").is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def addressed_to_loopback(host_header: str) -> bool:
    """Whether an HTTP Host header ("127.0.0.1:8600", "[::1]:8600", "localhost") names a loopback host."""
    try:
        host = urlsplit(f"//{host_header}").hostname
    except ValueError:   # e.g. "[::1" : not a host at all
        return False
    return host is not None and is_loopback(host)
