"""FlashMoE dashboard: `streamlit run dashboard/app.py`. Navigation, each page's heading and the shared sidebar."""
from __future__ import annotations

import streamlit as st

from dashboard import auth, pages, settings

st.set_page_config(page_title="FlashMoE", page_icon=":material/memory:", layout="wide")

NAVIGATION = {st.Page(p.path, title=p.title, icon=p.icon, default=p.default, url_path=p.url_path or None): p
              for p in pages.PAGES}

page = st.navigation(list(NAVIGATION))
with st.sidebar:
    st.selectbox("History", list(settings.WINDOWS), key="window",
                 index=list(settings.WINDOWS).index(settings.DEFAULT_WINDOW))
    st.caption(f"Store: `{settings.db_path()}`  \nAgent: `{settings.agent_url()}`  \n"
               f"Refreshes every {settings.REFRESH_S} s")
    auth.sidebar()
st.title(NAVIGATION[page].heading)
page.run()
