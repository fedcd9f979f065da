"""``trace view``: the rollout trees of a work dir as a page for a person (served on 127.0.0.1
or written as one self-contained HTML file), read-only from the DuckDB store."""

from trace_rl.view.data import ViewError, open_store, page_data
from trace_rl.view.page import render, step_page, write_page

__all__ = ["ViewError", "open_store", "page_data", "render", "step_page", "write_page"]
