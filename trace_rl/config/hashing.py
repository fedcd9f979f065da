"""The hash in a run's id: which ``TrainConfig`` fields enter it, and why the others do not.

A run id is ``<run_name>-<config hash>`` (``TrainConfig.resolved_run_id``), so the hash must stay
the same for a config that computes the same thing: re-running it resumes the run. It covers
every field that changes results, not the run's name or id, not where it executes or what it
keeps (``NEVER_HASHED``), and fields added after runs were made only when set
(``HASHED_UNLESS_DEFAULT``, and every family's own options), so adding one keeps the ids of the
runs made before it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from trace_rl.config.sections import FIELDS

HASHED_UNLESS_DEFAULT = ("root_posterior", "root_oracle", "trainable_layers", "clip_ratio_c",
                         "tis_cap", "oracle_rollouts")
"""Fields added after runs were made: at their defaults they stay out of ``config_hash``, as a
family's own options do (``TrainConfig.options``: a family may gain one)."""
HASHED_AS_OLD_DEFAULT = {"checkpoint_every": (5, 1)}
"""Fields whose default changed without changing what a run computes: (new default, old
default); at the new default they enter ``config_hash`` as the old one, so the default config
keeps the run id it had (any other value is hashed as itself, as before)."""
NEVER_HASHED = ("cluster", "rollout_engines", "trainer_ranks", "trainer_strategy", "weight_sync",
                "keep_checkpoints")
"""Where a run executes and what it keeps on disk, not what it computes: never in
``config_hash`` (the run id), so a run resumes on a cluster of another size (docs/cluster.md)
or with another checkpoint retention."""


def config_hash(flat: dict[str, Any], options: Mapping[str, Any]) -> str:
    """The first 10 hex digits of the SHA-256 of a ``TrainConfig``'s hashed fields, as sorted
    JSON: ``flat`` is the config's flat form (``TrainConfig.to_dict``), ``options`` the defaults
    of its family's own options by name (each left out at its default)."""
    d = dict(flat)
    d.pop("run_name")
    d.pop("run_id")
    for name in NEVER_HASHED:
        del d[name]
    for name, (new, old) in HASHED_AS_OLD_DEFAULT.items():
        if d[name] == new:
            d[name] = old
    for name in HASHED_UNLESS_DEFAULT:
        if d[name] == FIELDS[name].default:
            del d[name]
    for name, default in options.items():
        if d[name] == default:
            del d[name]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
