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
