"""FlashMoE dashboard: `streamlit run dashboard/app.py`. Navigation and the shared sidebar only."""
from __future__ import annotations

import streamlit as st

from dashboard import settings

st.set_page_config(page_title="FlashMoE", page_icon=":material/memory:", layout="wide")

PAGES = [
    st.Page("views/overview.py", title="Overview", icon=":material/dashboard:", default=True),
    st.Page("views/cache.py", title="Cache", icon=":material/cached:"),
    st.Page("views/ssd.py", title="SSD", icon=":material/storage:"),
    st.Page("views/memory.py", title="Memory", icon=":material/memory:"),
    st.Page("views/tuning.py", title="Tuning", icon=":material/tune:"),
]

page = st.navigation(PAGES)
with st.sidebar:
    st.selectbox("History", list(settings.WINDOWS), key="window",
                 index=list(settings.WINDOWS).index(settings.DEFAULT_WINDOW))
    st.caption(f"Store: `{settings.db_path()}`  \nAgent: `{settings.agent_url()}`  \n"
               f"Refreshes every {settings.REFRESH_S} s")
page.run()
