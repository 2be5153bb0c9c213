"""Where the dashboard finds the store and the agent, and how much history it shows."""
from __future__ import annotations

import os

from dashboard.agent_client import TOKEN_ENV

DEFAULT_DB = "data/flashmoe.db"
DEFAULT_AGENT_URL = "http://127.0.0.1:8600"
REFRESH_S = 5                 # live pages re-read the store this often
BUCKETS = 240                 # points per chart: enough for a smooth line, few enough to stay fast
WINDOWS = {"15 min": 900, "1 h": 3600, "6 h": 6 * 3600, "24 h": 24 * 3600, "7 d": 7 * 24 * 3600}
DEFAULT_WINDOW = "15 min"


def db_path() -> str:
    return os.environ.get("FLASHMOE_DB", DEFAULT_DB)


def agent_url() -> str:
    return os.environ.get("FLASHMOE_AGENT_URL", DEFAULT_AGENT_URL).rstrip("/")


def agent_token() -> str | None:
    """The bearer token the agent's control calls need (the agent's --token / FLASHMOE_TOKEN), if any."""
    return os.environ.get(TOKEN_ENV) or None
