"""The ``bootstrap-policy`` flow: the project's own tiny CPU policy, warm-started by SFT on
synthetic expert traces (trace_rl.policy.bootstrap). Built once per machine: the policy is cached
under ``trace_rl.environ.cache_dir()`` (``$TRACE_CACHE_DIR``) by the hash of its inputs, and each
work dir gets a copy; a second call in the same work dir returns the existing directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import flow

from flows.common import NAMES_ITS_TASK_RUN, RELEASES_ENGINES, prepare_workdir
from trace_rl.config import TrainConfig, options_model
from trace_rl.environ import cache_dir
from trace_rl.policy.bootstrap import BootstrapConfig, bootstrap_policy

_DEFAULT = TrainConfig()


@flow(name="bootstrap-policy", log_prints=True,
      flow_run_name="bootstrap-policy {family} d{difficulty} seed {seed}", **RELEASES_ENGINES,
      **NAMES_ITS_TASK_RUN)
def bootstrap(family: str = _DEFAULT.family, difficulty: int = _DEFAULT.difficulty,
              workdir: str | None = None, seed: int = _DEFAULT.seed,
              preset: str = BootstrapConfig.model_fields["preset"].default,
              mix: list[int] | None = None, options: dict[str, Any] | None = None) -> str:
    """Make (or reuse) the tiny policy for a family; return its HF directory.

    Policies of other options get their own directory (options at their defaults are left out
    of the directory name and the input hash).

    Args:
        family: The task family the policy is warm-started on (default: what trace train with
            no config bootstraps).
        difficulty: Difficulty of the synthetic items.
        workdir: The work dir that gets a copy of the policy (default trace_runs).
        seed: Seed of the build.
        preset: Model size (tiny policy presets).
        mix: Item difficulties taken in turn (SynthConfig.mix); empty means difficulty alone.
        options: The family's generator options (TrainConfig.family_options).
    """
    tag = f"-m{''.join(str(d) for d in mix)}" if mix else ""
    # Only the options that differ from their defaults name the policy: a family that gains an
    # option (with a default) keeps its policies' directories and cache keys.
    own = options_model(family).model_fields
    options = {k: v for k, v in (options or {}).items() if v != own[k].default}
    if options:
        tag += "-o" + hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    out = Path(prepare_workdir(workdir)) / "policies" / f"{preset}-{family}-d{difficulty}{tag}-s{seed}"
    return str(bootstrap_policy(family, out, difficulty=difficulty, preset=preset, seed=seed,
                                mix=tuple(mix or ()), options=tuple(sorted((options or {}).items())),
                                cache_dir=cache_dir(), show_progress=True))
