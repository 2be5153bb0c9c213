"""A service's address as a setting names it (access/address.py): what is no address, and why."""
import pytest

from access.address import url_problem


@pytest.mark.parametrize("url, problem", [
    ("http://[::1", "does not parse as a URL (Invalid IPv6 URL)"),
    ("http://127.0.0.1:abc", "does not parse as a URL"),
    ("http://127.0.0.1:99999", "does not parse as a URL (Port out of range 0-65535)"),
    ("notaurl", "is not an http:// or https:// URL"), ("ftp://x", "is not an http:// or https:// URL"),
    ("http://", "names no host"), ("http://:8600", "names no host"),
    ("http://127.0.0.1:0", "its port is 0"),
    ("http://127.0.0.1 :8600", "holds white space"),
    ("http://127.0.0.1:8600/?x", "has a query or fragment"), ("http://127.0.0.1:8600#top", "has a query or fragment"),
])
def test_what_is_no_address_says_why(url, problem):
    assert problem in url_problem(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8600", "https://prometheus.lan:9090", "http://[::1]:8600",
                                 "http://edge-01.lan", "https://proxy.lan/flashmoe"])
def test_addresses_pass(url):
    assert url_problem(url) is None
