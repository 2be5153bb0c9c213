"""The address of a service a setting names (the agent, Prometheus), checked where the setting is read.

A mistyped address is said as such. Left to the HTTP client it was a traceback (`http://[::1`, a port
`abc`: httpx.InvalidURL is no transport error) or a service "down" that no start would bring up
(`notaurl`, a port 99999).
"""
from __future__ import annotations

from urllib.parse import urlsplit


def url_problem(url: str) -> str | None:
    """Why `url` is no http(s) address of a service whose paths are appended to it, or None if it is one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:           # an unclosed [IPv6 literal, a port that is not a number or over 65535
        return f"it does not parse as a URL ({err})"
    if any(c.isspace() for c in url):
        return "it holds white space"
    if parts.scheme not in ("http", "https"):
        return "it is not an http:// or https:// URL"
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "its port is 0, which no service listens on"
    if parts.query or parts.fragment:
        return "it has a query or fragment, which the paths appended to it would land in"
    return None
