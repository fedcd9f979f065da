"""Checking and staging the store's input: a level's nodes, its allocations and ledger row, and
value updates, as Arrow tables ready to insert.

Every check is column-wise (a level of a 4,096-leaf step has ~10^4 rows); a bad row is named in
the error (``(tree T, slot S)`` or its node id) with the column and what to fix, and nothing is
written. The store derives the ids, the run/step/level and the token counts itself
(``DERIVED_NODE_COLUMNS``); a caller that gives one anyway must give the same value.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trace_rl.storage.published import StoreError
from trace_rl.storage.schema import (ALLOCATION_INPUT, DERIVED_NODE_COLUMNS, LEDGER_FIELDS, NODE_INPUT,
                                    UPDATABLE)

# Column order of the nodes table, as created by TABLES_DDL.
NODE_COLUMNS = (
    "node_id", "parent_id", "tree_id", "root_id", "run_id", "step", "level", "depth",
    "local_index", "parent_index", "item_id", "family", "text", "action_json", "observation",
    "gen_token_ids", "obs_token_ids", "gen_logprobs", "gen_tokens", "obs_tokens", "tool_called",
    "error", "predicted_v", "allocated_k", "reward", "value", "n_leaves", "advantage", "allocator",
    "is_leaf", "created_at",
)
ALLOCATION_COLUMNS = ("run_id", "step", "level", "node_id", "allocator", "item_id", "predicted_v",
                      "true_v", "k", "gain")
_UNIT_INTERVAL = ("predicted_v", "value", "reward")
_NON_NEGATIVE = ("allocated_k", "n_leaves", "depth", "local_index", "tree_id")


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _conform(t: pa.Table, spec: Mapping[str, tuple[pa.DataType, bool]], what: str,
             allowed_extra: Sequence[str] = ()) -> dict[str, pa.ChunkedArray]:
    """Check names, required columns, nulls and types of an input table; return cast columns."""
    if not isinstance(t, pa.Table):
        raise StoreError(f"{what}: expected a pyarrow.Table, got {type(t).__name__}")
    unknown = [c for c in t.column_names if c not in spec and c not in allowed_extra]
    if unknown:
        raise StoreError(f"{what}: unknown column(s) {unknown}; allowed: {sorted(spec)} "
                         f"plus derived {list(allowed_extra)}")
    if len(set(t.column_names)) != len(t.column_names):
        raise StoreError(f"{what}: duplicate column names in {t.column_names}")
    missing = [c for c, (_, req) in spec.items() if req and c not in t.column_names]
    if missing:
        raise StoreError(f"{what}: missing required column(s) {missing}")
    out = {}
    for name, (typ, required) in spec.items():
        if name not in t.column_names:
            out[name] = pa.chunked_array([pa.nulls(t.num_rows, typ)])
            continue
        col = t.column(name)
        try:
            out[name] = col.cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise StoreError(f"{what}: column {name!r} has type {col.type}, expected {typ} "
                             f"({exc})") from exc
        if required and out[name].null_count:
            raise StoreError(f"{what}: column {name!r} has {out[name].null_count} null(s); it is "
                             f"required on every row")
    return out


def _first_bad(mask: pa.ChunkedArray, col: pa.ChunkedArray, labels: list[Any]) -> str:
    i = pc.index(pc.fill_null(mask, False), True).as_py()
    return f"row {labels[i]} has {col[i].as_py()!r}"


def _check_ranges(cols: Mapping[str, pa.ChunkedArray], what: str, labels: list[Any],
                  unit: Sequence[str] = _UNIT_INTERVAL, nonneg: Sequence[str] = _NON_NEGATIVE) -> None:
    for name in (*unit, *nonneg):
        if name not in cols:
            continue
        c = cols[name]
        bad = pc.or_(pc.less(c, 0), pc.greater(c, 1)) if name in unit else pc.less(c, 0)
        if pc.any(bad).as_py():
            rule = "lie in [0, 1]" if name in unit else "be >= 0"
            raise StoreError(f"{what}: column {name!r} must {rule}; {_first_bad(bad, c, labels)}")


def stage_nodes(run_id: str, step: int, level: int, t: pa.Table) -> pa.Table:
    """Check a level's node input and add the derived columns, column by column (a level of a
    4,096-leaf step has ~10^4 rows: no per-row Python on this path except to name a bad row)."""
    what = f"write_level(run={run_id}, step={step}, level={level}) nodes"
    cols = _conform(t, NODE_INPUT, what, allowed_extra=DERIVED_NODE_COLUMNS)
    n = t.num_rows
    if n == 0:
        raise StoreError(f"{what}: no rows")
    labels = _SlotLabels(cols["tree_id"].to_numpy(), cols["local_index"].to_numpy())
    _check_ranges(cols, what, labels)
    _check_tree_shape(cols, what, labels)
    derived = _derived_columns(cols, run_id, step, level, n)
    _check_given_derived(t, derived, what, labels)
    _check_logprobs(cols, what, labels)
    data = {name: derived[name] if name in derived else cols.get(name) for name in NODE_COLUMNS}
    data["created_at"] = pa.array([utc_now()] * n, pa.timestamp("us"))
    return pa.table(data)


def _check_tree_shape(cols: Mapping[str, pa.ChunkedArray], what: str, labels: "_SlotLabels") -> None:
    """Each (tree, slot) once; the root at slot 0 with parent -1 and depth 0, every other node's
    parent an earlier slot; every leaf with its reward."""
    tree, local = labels.tree, labels.local
    parent = cols["parent_index"].to_numpy()
    depth = cols["depth"].to_numpy()
    if len(np.unique(np.stack([tree, local]), axis=1)[0]) != len(tree):
        raise StoreError(f"{what}: columns 'tree_id', 'local_index' repeat a (tree, slot) pair")
    root = parent == -1
    bad = np.flatnonzero((root != (local == 0)) | (root != (depth == 0))
                         | (~root & ~((0 <= parent) & (parent < local))))
    if len(bad):
        i = int(bad[0])
        raise StoreError(
            f"{what}: column 'parent_index' at {labels[i]}: the root is slot 0 with "
            f"parent_index -1 and depth 0, every other node has 0 <= parent_index < "
            f"local_index and depth >= 1 (got parent_index {parent[i]}, depth {depth[i]})")
    leaf = cols["is_leaf"].to_numpy()
    bad = np.flatnonzero(leaf & cols["reward"].is_null().to_numpy(zero_copy_only=False))
    if len(bad):
        raise StoreError(f"{what}: column 'reward' is null at leaf {labels[int(bad[0])]}; leaves "
                         f"are written after their reward")


def _derived_columns(cols: Mapping[str, pa.ChunkedArray], run_id: str, step: int, level: int,
                     n: int) -> dict[str, Any]:
    """The columns the store derives: node, parent and root ids (``make_node_id``'s format),
    the run, step and level, and the token counts."""
    prefix = f"{run_id}/s{step}/t"
    tree_s = pc.cast(cols["tree_id"], pa.string())

    def node_ids(slot: pa.ChunkedArray) -> pa.ChunkedArray:
        return pc.binary_join_element_wise(prefix, tree_s, "/n", pc.cast(slot, pa.string()), "")

    return {
        "node_id": node_ids(cols["local_index"]),
        "parent_id": node_ids(pc.if_else(pc.equal(cols["parent_index"], -1), None,
                                         cols["parent_index"])),
        "root_id": node_ids(pc.multiply(cols["local_index"], 0)),
        "run_id": pa.repeat(run_id, n), "step": pa.repeat(step, n), "level": pa.repeat(level, n),
        "gen_tokens": pc.fill_null(pc.list_value_length(cols["gen_token_ids"]), 0).cast(pa.int64()),
        "obs_tokens": pc.fill_null(pc.list_value_length(cols["obs_token_ids"]), 0).cast(pa.int64()),
    }


def _check_given_derived(t: pa.Table, derived: Mapping[str, Any], what: str,
                         labels: "_SlotLabels") -> None:
    """A derived column the caller gave anyway must equal what the store derives."""
    n = t.num_rows
    for name in DERIVED_NODE_COLUMNS:
        if name in t.column_names:
            given, want = t.column(name), derived[name]
            same = pc.fill_null(pc.equal(given.cast(want.type), want), False) if \
                given.type != pa.null() else pa.repeat(False, n)
            same = pc.or_(same, pc.and_(pc.is_null(given), pc.is_null(want)))
            if not pc.all(same).as_py():
                i = pc.index(same, False).as_py()
                raise StoreError(f"{what}: column {name!r} at {labels[i]} is {given[i].as_py()!r} "
                                 f"but the store derives {want[i].as_py()!r}; omit the column or "
                                 f"fix it")


def _check_logprobs(cols: Mapping[str, pa.ChunkedArray], what: str, labels: "_SlotLabels") -> None:
    """One sampling log-probability per generated token, where log-probabilities are given."""
    lp_len = pc.list_value_length(cols["gen_logprobs"])
    gen_len = pc.fill_null(pc.list_value_length(cols["gen_token_ids"]), 0)
    bad = pc.fill_null(pc.not_equal(lp_len, gen_len), False)
    if pc.any(bad).as_py():
        i = pc.index(bad, True).as_py()
        raise StoreError(f"{what}: column 'gen_logprobs' at {labels[i]} has {lp_len[i].as_py()} "
                         f"entries for {gen_len[i].as_py()} gen_token_ids")


class _ColumnLabels:
    """Row labels for error messages: the row's value of a column (e.g. its node id)."""

    def __init__(self, column: pa.ChunkedArray):
        self.column = column

    def __getitem__(self, i: int) -> Any:
        return self.column[i].as_py()


class _SlotLabels:
    """Row labels ``(tree T, slot S)`` for error messages, made only for the row named."""

    def __init__(self, tree: np.ndarray, local: np.ndarray):
        self.tree, self.local = tree, local

    def __getitem__(self, i: int) -> str:
        return f"(tree {self.tree[i]}, slot {self.local[i]})"


def stage_allocations(run_id: str, step: int, level: int, t: pa.Table) -> pa.Table:
    what = f"write_level(run={run_id}, step={step}, level={level}) allocations"
    cols = _conform(t, ALLOCATION_INPUT, what)
    labels = cols["node_id"].to_pylist()
    _check_ranges(cols, what, labels, unit=("predicted_v", "true_v"), nonneg=("k",))
    keys = list(zip(labels, cols["allocator"].to_pylist()))
    if len(set(keys)) != len(keys):
        raise StoreError(f"{what}: columns 'node_id', 'allocator' repeat a pair")
    n = t.num_rows
    data = {"run_id": [run_id] * n, "step": [step] * n, "level": [level] * n}
    return pa.table({c: data.get(c, cols.get(c)) for c in ALLOCATION_COLUMNS})


def ledger_row(run_id: str, step: int, level: int, ledger: Mapping[str, Any]) -> list[Any]:
    what = f"write_level(run={run_id}, step={step}, level={level}) ledger"
    expected = ("method",) + LEDGER_FIELDS
    unknown = sorted(set(ledger) - set(expected))
    missing = [k for k in expected if k not in ledger]
    if unknown or missing:
        raise StoreError(f"{what}: keys must be {list(expected)}; missing {missing}, "
                         f"unknown {unknown}")
    if not isinstance(ledger["method"], str) or not ledger["method"]:
        raise StoreError(f"{what}: 'method' must be a non-empty string")
    row: list[Any] = [run_id, step, level, ledger["method"]]
    for k in LEDGER_FIELDS:
        v = ledger[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
                (k != "wall_seconds" and int(v) != v):
            raise StoreError(f"{what}: {k!r} must be a non-negative "
                             f"{'number' if k == 'wall_seconds' else 'integer'}, got {v!r}")
        row.append(float(v) if k == "wall_seconds" else int(v))
    return row


def stage_updates(t: pa.Table) -> pa.Table:
    what = "update_values"
    spec = {"node_id": (pa.string(), True)} | {c: (typ, False) for c, typ in UPDATABLE.items()}
    cols = _conform(t, spec, what)
    present = [c for c in UPDATABLE if c in t.column_names]
    if not present:
        raise StoreError(f"{what}: give node_id and at least one of {list(UPDATABLE)}")
    if pc.count_distinct(cols["node_id"]).as_py() != t.num_rows:
        raise StoreError(f"{what}: column 'node_id' repeats an id")
    _check_ranges({c: cols[c] for c in present}, what, _ColumnLabels(cols["node_id"]))
    return pa.table({"node_id": cols["node_id"], **{c: cols[c] for c in present}})
