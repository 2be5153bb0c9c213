"""FlashMoE dashboard: `streamlit run dashboard/app.py`. Navigation, each page's heading and the shared sidebar."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import auth, components, pages, settings

# A local favicon: a ":material/...:" one is fetched from fonts.gstatic.com, a request that leaves the box.
st.set_page_config(page_title="FlashMoE", page_icon=str(Path(__file__).with_name("icon.png")), layout="wide")

NAVIGATION = {st.Page(p.path, title=p.title, icon=p.icon, default=p.default, url_path=p.url_path or None): p
              for p in pages.PAGES}

page = st.navigation(list(NAVIGATION))
with st.sidebar:
    components.sidebar()
    st.caption(f"Store: `{settings.db_path()}`  \nAgent: `{settings.agent_url()}`  \nTimes in UTC")
    auth.sidebar()
st.title(NAVIGATION[page].heading)
page.run()
