"""The dashboard's gate in front of control actions: when it is locked, and why.

On loopback (the repository's .streamlit/config.toml) control is open; exposed, a session must enter
the agent's token first, and without a token configured the dashboard is read-only. The pages
against a real agent, exposed: tests/test_dashboard_agent.py.
"""
from __future__ import annotations

import pytest

from dashboard import auth

TOKEN = "dashboard-auth-test-token"


@pytest.mark.parametrize("address, token, unlocked, words", [
    ("127.0.0.1", None, False, None),
    ("localhost", TOKEN, False, None),
    ("::1", TOKEN, False, None),
    ("0.0.0.0", TOKEN, False, "enter the agent's token"),
    (None, TOKEN, False, "enter the agent's token"),          # unset: every interface
    ("box.example", TOKEN, False, "enter the agent's token"),  # a name may resolve anywhere
    ("0.0.0.0", TOKEN, True, None),
    ("0.0.0.0", None, True, "has no FLASHMOE_TOKEN"),
    (None, None, False, "listens on every interface"),
])
def test_lock_reason(address, token, unlocked, words):
    reason = auth.lock_reason(address, token, unlocked)
    assert reason is None if words is None else words in reason


@pytest.mark.parametrize("host, token, unlocked, words", [
    ("127.0.0.1:8501", None, False, None),
    ("localhost:8501", None, False, None),
    ("[::1]:8501", None, False, None),
    ("rebind.example:8501", None, False, "reached as 'rebind.example:8501', not as 127.0.0.1"),  # DNS rebinding
    ("rebind.example:8501", TOKEN, False, "enter the agent's token"),
    ("rebind.example:8501", TOKEN, True, None),
    ("[bad", None, False, "not as 127.0.0.1"),
])
def test_a_loopback_dashboard_reached_under_another_host_name_is_locked(host, token, unlocked, words):
    """A loopback dashboard's control was open to any page a browser on the box loaded: one that
    re-points its own name at 127.0.0.1 reaches it under that name, and the dashboard then sends the
    knob with its own token (or to a token-less agent, from 127.0.0.1, which the agent accepts)."""
    reason = auth.lock_reason("127.0.0.1", token, unlocked, host)
    assert reason is None if words is None else words in reason
