"""DDL of the TRACE tree store: tables, the node-input contract, and the analysis views.

Kept as Python strings (not a .sql file) so that it ships with the package without package-data
rules. docs/schema.md documents every column; keep the two in step.

The nodes table maps one-to-one onto trace_core's struct-of-arrays tree (docs/schema.md): one row
per array slot, ``local_index`` is the slot, ``parent_index`` the parent slot (-1 at the root).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

TABLES_DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS runs (
    run_id              TEXT PRIMARY KEY,
    created_at          TIMESTAMP NOT NULL,
    config_json         TEXT NOT NULL,
    status              TEXT NOT NULL,
    mlflow_run_id       TEXT,
    prefect_flow_run_id TEXT
);

CREATE TABLE IF NOT EXISTS nodes (
    node_id       TEXT PRIMARY KEY,
    parent_id     TEXT,
    tree_id       INTEGER NOT NULL,
    root_id       TEXT NOT NULL,
    run_id        TEXT NOT NULL,
    step          INTEGER NOT NULL,
    level         INTEGER NOT NULL,
    depth         INTEGER NOT NULL,
    local_index   INTEGER NOT NULL,
    parent_index  INTEGER NOT NULL,
    item_id       TEXT NOT NULL,
    family        TEXT,
    text          TEXT,
    action_json   TEXT,
    observation   TEXT,
    gen_token_ids INTEGER[],
    obs_token_ids INTEGER[],
    gen_logprobs  FLOAT[],
    gen_tokens    INTEGER NOT NULL,
    obs_tokens    INTEGER NOT NULL,
    tool_called   BOOLEAN,
    error         BOOLEAN,
    predicted_v   DOUBLE,
    allocated_k   INTEGER,
    reward        DOUBLE,
    value         DOUBLE,
    n_leaves      INTEGER,
    advantage     DOUBLE,
    allocator     TEXT,
    is_leaf       BOOLEAN NOT NULL,
    created_at    TIMESTAMP NOT NULL
);

CREATE TABLE IF NOT EXISTS steps (
    run_id       TEXT NOT NULL,
    step         INTEGER NOT NULL,
    status       TEXT NOT NULL,
    started_at   TIMESTAMP NOT NULL,
    finished_at  TIMESTAMP,
    metrics_json TEXT,
    PRIMARY KEY (run_id, step)
);

CREATE TABLE IF NOT EXISTS allocations (
    run_id      TEXT NOT NULL,
    step        INTEGER NOT NULL,
    level       INTEGER NOT NULL,
    node_id     TEXT NOT NULL,
    allocator   TEXT NOT NULL,
    item_id     TEXT,
    predicted_v DOUBLE,
    true_v      DOUBLE,
    k           INTEGER NOT NULL,
    gain        DOUBLE,
    PRIMARY KEY (run_id, step, level, node_id, allocator)
);

CREATE TABLE IF NOT EXISTS ledger (
    run_id           TEXT NOT NULL,
    step             INTEGER NOT NULL,
    level            INTEGER NOT NULL,
    method           TEXT NOT NULL,
    trajectories     BIGINT NOT NULL,
    prompt_tokens    BIGINT NOT NULL,
    generated_tokens BIGINT NOT NULL,
    tool_calls       BIGINT NOT NULL,
    wall_seconds     DOUBLE NOT NULL,
    PRIMARY KEY (run_id, step, level, method)
);

CREATE TABLE IF NOT EXISTS evals (
    run_id           TEXT NOT NULL,
    step             INTEGER NOT NULL,  -- 0: before the first update; steps: after the last
    policy_dir       TEXT NOT NULL,
    split            TEXT NOT NULL,
    skip             INTEGER NOT NULL,  -- items of the split passed over (a bootstrap's own)
    items            INTEGER NOT NULL,
    samples          INTEGER NOT NULL,
    temperature      DOUBLE NOT NULL,
    accuracy         DOUBLE NOT NULL,
    ci_low           DOUBLE,            -- 95% interval over items (trace_core.stats)
    ci_high          DOUBLE,
    per_item         DOUBLE[] NOT NULL, -- success rate of each item, in item order
    generated_tokens BIGINT NOT NULL,
    tool_calls       BIGINT NOT NULL,
    created_at       TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, step)
);
"""

# Views are recreated on every schema init so that a fix to a view reaches old databases.
VIEWS_DDL = """
-- Every root-to-leaf path, node ids in root -> leaf order.
CREATE OR REPLACE VIEW paths AS
WITH RECURSIVE walk(run_id, step, tree_id, root_id, item_id, node_id, node_ids, is_leaf,
                    reward, leaf_level) AS (
    SELECT run_id, step, tree_id, root_id, item_id, node_id, [node_id], is_leaf, reward, level
    FROM nodes WHERE parent_id IS NULL
    UNION ALL
    SELECT w.run_id, w.step, w.tree_id, w.root_id, w.item_id, c.node_id,
           list_append(w.node_ids, c.node_id), c.is_leaf, c.reward, c.level
    FROM walk w JOIN nodes c ON c.parent_id = w.node_id
)
SELECT run_id, step, tree_id, root_id, item_id, node_id AS leaf_id, node_ids,
       len(node_ids) - 1 AS depth, leaf_level, reward
FROM walk WHERE is_leaf;

-- Leaf outcomes below every node, computed from the leaves themselves (not from the stored
-- backup), so these views hold before update_values runs and can check it afterwards.
CREATE OR REPLACE VIEW subtree_stats AS
WITH RECURSIVE up(node_id, reward) AS (
    SELECT node_id, reward FROM nodes WHERE is_leaf
    UNION ALL
    SELECT n.parent_id, up.reward
    FROM up JOIN nodes n ON n.node_id = up.node_id
    WHERE n.parent_id IS NOT NULL
)
SELECT node_id,
       count(*)::INTEGER AS leaves_below,
       sum(reward) AS reward_sum,
       avg(reward) AS leaf_mean,
       min(reward) AS min_reward,
       max(reward) AS max_reward
FROM up GROUP BY node_id;

-- Internal nodes whose subtree holds both a success and a failure.
CREATE OR REPLACE VIEW mixed_anchors AS
SELECT n.run_id, n.step, n.tree_id, n.node_id, n.parent_id, n.level, n.depth, n.item_id,
       n.predicted_v, n.value, s.leaves_below, s.reward_sum AS successes, s.leaf_mean
FROM nodes n JOIN subtree_stats s USING (node_id)
WHERE NOT n.is_leaf AND s.min_reward < s.max_reward;

-- Ordered sibling pairs (better, worse) whose subtrees' leaf success rates differ.
CREATE OR REPLACE VIEW contrast_pairs AS
SELECT a.run_id, a.step, a.tree_id, a.parent_id, p.depth AS branch_depth,
       a.node_id AS better_id, b.node_id AS worse_id,
       sa.leaf_mean AS better_rate, sb.leaf_mean AS worse_rate,
       sa.leaf_mean - sb.leaf_mean AS delta,
       (sa.min_reward = 1 AND sb.max_reward = 0) AS pure
FROM nodes a
JOIN nodes b ON b.parent_id = a.parent_id AND b.node_id <> a.node_id
JOIN subtree_stats sa ON sa.node_id = a.node_id
JOIN subtree_stats sb ON sb.node_id = b.node_id
JOIN nodes p ON p.node_id = a.parent_id
WHERE sa.leaf_mean > sb.leaf_mean;

-- Per run / step / method cost totals over all levels.
CREATE OR REPLACE VIEW step_ledger AS
SELECT run_id, step, method,
       count(*)::INTEGER AS levels,
       sum(trajectories)::BIGINT AS trajectories,
       sum(prompt_tokens)::BIGINT AS prompt_tokens,
       sum(generated_tokens)::BIGINT AS generated_tokens,
       sum(tool_calls)::BIGINT AS tool_calls,
       sum(wall_seconds) AS wall_seconds
FROM ledger GROUP BY run_id, step, method;
"""

# The node-input contract of TreeStore.write_level: column -> (arrow type, required).
# Columns the store derives (node_id, parent_id, root_id, run_id, step, level, gen_tokens,
# obs_tokens) may be given too; then they must agree; created_at is the store's alone.
NODE_INPUT: dict[str, tuple[pa.DataType, bool]] = {
    "tree_id": (pa.int64(), True),
    "local_index": (pa.int64(), True),
    "parent_index": (pa.int64(), True),
    "depth": (pa.int64(), True),
    "item_id": (pa.string(), True),
    "is_leaf": (pa.bool_(), True),
    "family": (pa.string(), False),
    "text": (pa.string(), False),
    "action_json": (pa.string(), False),
    "observation": (pa.string(), False),
    "gen_token_ids": (pa.list_(pa.int64()), False),
    "obs_token_ids": (pa.list_(pa.int64()), False),
    "gen_logprobs": (pa.list_(pa.float64()), False),
    "tool_called": (pa.bool_(), False),
    "error": (pa.bool_(), False),
    "predicted_v": (pa.float64(), False),
    "allocated_k": (pa.int64(), False),
    "reward": (pa.float64(), False),
    "value": (pa.float64(), False),
    "n_leaves": (pa.int64(), False),
    "advantage": (pa.float64(), False),
    "allocator": (pa.string(), False),
}
# For building node input with pa.Table.from_pylist(rows, schema=NODE_INPUT_SCHEMA): rows may omit
# optional keys (they become nulls).
NODE_INPUT_SCHEMA = pa.schema([(name, typ) for name, (typ, _) in NODE_INPUT.items()])
DERIVED_NODE_COLUMNS = ("node_id", "parent_id", "root_id", "run_id", "step", "level",
                        "gen_tokens", "obs_tokens")

ALLOCATION_INPUT: dict[str, tuple[pa.DataType, bool]] = {
    "node_id": (pa.string(), True),
    "allocator": (pa.string(), True),
    "k": (pa.int64(), True),
    "item_id": (pa.string(), False),
    "predicted_v": (pa.float64(), False),
    "true_v": (pa.float64(), False),
    "gain": (pa.float64(), False),
}

LEDGER_FIELDS = ("trajectories", "prompt_tokens", "generated_tokens", "tool_calls",
                 "wall_seconds")

# Columns update_values may change after a level is written (backup, scoring, allocation).
UPDATABLE: dict[str, pa.DataType] = {
    "value": pa.float64(),
    "n_leaves": pa.int64(),
    "advantage": pa.float64(),
    "predicted_v": pa.float64(),
    "allocated_k": pa.int64(),
}
