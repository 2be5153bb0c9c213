"""Where the dashboard finds the store and the agent, and how finely it charts."""
from __future__ import annotations

import os

from dashboard.agent_client import TOKEN_ENV

DB_ENV = "FLASHMOE_DB"
DEFAULT_DB = "data/flashmoe.db"
DEFAULT_AGENT_URL = "http://127.0.0.1:8600"
BUCKETS = 240                 # points per chart: enough for a smooth line, few enough to stay fast


def db_path() -> str:
    return os.environ.get(DB_ENV, DEFAULT_DB)


def agent_url() -> str:
    return os.environ.get("FLASHMOE_AGENT_URL", DEFAULT_AGENT_URL).rstrip("/")


def agent_token() -> str | None:
    """The bearer token the agent's control calls need (the agent's --token / FLASHMOE_TOKEN), if any."""
    return os.environ.get(TOKEN_ENV) or None
