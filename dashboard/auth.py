"""The dashboard's gate in front of control actions: knob changes, the Memory page's recommendation,
the Cache page's cap sweep.

Bound to loopback (the default: .streamlit/config.toml, the Procfile) the dashboard is reached only
from the box itself or through an SSH tunnel, and control actions are open. Bound to any other
address, a visitor must first enter the agent's token (FLASHMOE_TOKEN, which the dashboard also
sends to the agent on control calls) in the sidebar; the browser session stays unlocked until it
ends or is locked again; wrong tokens lock their address out for a while, across sessions
(access.guesses). An exposed dashboard without a token is read-only. Reading needs no token.
The gate is checked where the action is sent (data.apply_knobs, the sweep's start), not only by disabling
buttons, since a browser can send a click on a disabled button.
"""
from __future__ import annotations

import logging
import secrets

import streamlit as st

from access.guesses import GuessLimit, lockout_message
from access.loopback import addressed_to_loopback, is_loopback
from dashboard import settings
from dashboard.agent_client import TOKEN_ENV

log = logging.getLogger(__name__)

UNLOCKED = "control-unlocked"    # session_state key: this browser session entered the token


def _reached_on_loopback(host_header: str | None) -> bool:
    """Whether a session's Host header names a loopback host (access.loopback: DNS rebinding). No header
    (no HTTP request: Streamlit's AppTest) counts as loopback; a browser always sends one."""
    return host_header is None or addressed_to_loopback(host_header)


def lock_reason(address: str | None, token: str | None, unlocked: bool, host: str | None = None) -> str | None:
    """Why control actions are refused for this session (reached under the Host header `host`), or None
    when they are allowed."""
    if (is_loopback(address) and _reached_on_loopback(host)) or (unlocked and token):
        return None
    where = (f"this page was reached as {host!r}, not as 127.0.0.1 or localhost" if is_loopback(address)
             else f"this dashboard listens on {address or 'every interface'}")
    if not token:
        return (f"control is off: {where}, and it has no {TOKEN_ENV}; start it with {TOKEN_ENV} set to the "
                "agent's token, or open it at 127.0.0.1")
    return "control is locked: enter the agent's token under Control in the sidebar"


def _host() -> str | None:
    return st.context.headers.get("Host")


def control_lock() -> str | None:
    """lock_reason for the running dashboard and this browser session."""
    return lock_reason(st.get_option("server.address"), settings.agent_token(), st.session_state.get(UNLOCKED, False),
                       _host())


def sidebar() -> None:
    """The token form of an exposed dashboard (nothing on loopback reached as a loopback host)."""
    address, token = st.get_option("server.address"), settings.agent_token()
    if is_loopback(address) and _reached_on_loopback(_host()):
        return
    st.subheader("Control")
    if not token:
        st.caption(lock_reason(address, token, False, _host()))
    elif st.session_state.get(UNLOCKED):
        st.caption("Unlocked for this browser session.")
        if st.button("Lock", key="lock-control"):
            st.session_state[UNLOCKED] = False
            st.rerun()
    else:
        with st.form("unlock-control"):
            entered = st.text_input("Agent token", type="password", help=f"the agent's {TOKEN_ENV}")
            if st.form_submit_button("Unlock control"):
                _unlock(entered, token)


@st.cache_resource   # one for the dashboard process: a new browser session must not bring new guesses
def _guesses() -> GuessLimit:
    return GuessLimit()


def _unlock(entered: str, token: str) -> None:
    """The form's check, heard only while this client is not locked out for wrong tokens (access.guesses)."""
    address = st.context.ip_address
    client = address if isinstance(address, str) else "127.0.0.1"  # None on loopback (a stand-in under AppTest)
    guesses = _guesses()
    if wait := guesses.wait_s(client):
        st.error(lockout_message(wait).capitalize())
        return
    if secrets.compare_digest(entered.encode(), token.encode()):
        guesses.right(client)
        st.session_state[UNLOCKED] = True
        st.rerun()
    wrong = guesses.wrong(client, entered)
    log.warning("wrong token in the Unlock control form from %s (%s)%s", client,
                "one it entered before: no new guess" if wrong.repeated else f"{wrong.in_a_row} in a row",
                f"; locked out for {wrong.lock_s:.0f} s" if wrong.lock_s else "")
    st.error("That is not the agent's token." +
             (f" {lockout_message(wrong.lock_s).capitalize()}." if wrong.lock_s else ""))
