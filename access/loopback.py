"""Loopback addresses and names, and the Host header that names one.

A service bound to loopback is reached only from the box itself. A web page can reach it as well,
from the browser of someone on the box, under its own host name re-pointed at 127.0.0.1 (DNS
rebinding): the browser then deems the service the page's own origin and lets it send any request.
Such a request still names the page's host in its `Host` header, so what is open on loopback is
open only to requests addressed to a loopback host.
"""
from __future__ import annotations

import ipaddress
import re

# RFC 9110's Host: uri-host [":" port], the host a bracketed IPv6 literal or a name or IPv4 address; nothing else
# (no userinfo, path or query, which a URL parser would skip over to find a host in "evil.example@127.0.0.1").
_HOST = re.compile(r"(?:\[(?P<literal>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._~%!$&'()*+,;=-]+))(?::[0-9]*)?")


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
    match = _HOST.fullmatch(host_header)
    return match is not None and is_loopback((match["literal"] or match["name"]).lower())
