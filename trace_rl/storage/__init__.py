"""Storage adapters: the DuckDB tree store, MLflow tracking and the figures logged to it."""

from trace_rl.storage.store import (
    StoreBusyError,
    StoreError,
    TreeStore,
    WriteResult,
    make_node_id,
)

__all__ = ["StoreBusyError", "StoreError", "TreeStore", "WriteResult", "make_node_id"]
