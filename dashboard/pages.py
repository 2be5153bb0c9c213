"""The dashboard's pages, declared once: the app's navigation, its tests and its benchmark read this.

A page is `views/<key>.py`; its URL is `/<key>` (the default page's is `/`). Adding a page is a
view file plus one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Page:
    key: str                  # the view's file name without .py, and its URL path
    title: str                # in the navigation
    heading: str              # at the top of the page
    icon: str
    default: bool = False
    reads_store: bool = True  # False: the page reads elsewhere (Fleet: Prometheus) and says nothing of the store

    @property
    def path(self) -> str:
        """The view file, relative to dashboard/app.py (what st.Page and AppTest.switch_page take)."""
        return f"views/{self.key}.py"

    @property
    def url_path(self) -> str:
        return "" if self.default else self.key


PAGES: tuple[Page, ...] = (
    Page("overview", "Overview", "Overview", ":material/dashboard:", default=True),
    Page("cache", "Cache", "Expert cache", ":material/cached:"),
    Page("ssd", "SSD", "SSD", ":material/storage:"),
    Page("memory", "Memory", "Memory", ":material/memory:"),
    Page("tuning", "Tuning", "Tuning", ":material/tune:"),
    Page("fleet", "Fleet", "Fleet", ":material/lan:", reads_store=False),
)


def page(key: str) -> Page:
    """The page whose view is `views/<key>.py`."""
    return next(p for p in PAGES if p.key == key)
