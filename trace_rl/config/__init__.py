"""The configuration of a run, in one package.

* ``sections``: every field, declared once in one model per concern (run, task, rollout,
  allocation, update, predictor, eval, cluster), each with a type, a range and one sentence of
  documentation; a family's own options are declared with the family (``trace_rl/envs/<family>/``,
  its registered ``options`` model) and listed by ``family_fields``.
* ``model``: ``TrainConfig``, the frozen tree of those sections and the family's options (a union
  keyed by ``family``), with every field also reachable by its flat name, the cross-field rules
  and the settings derived for the layers below.
* ``hashing``: which fields enter the config hash in a run id, and why the others do not.
* ``load``: ``load_config`` and ``config_from_mapping`` (defaults, then a YAML file, then
  ``key=value`` overrides, flat or dotted, validated once), and ``load_settings``, the same
  reading of ``key=value`` arguments for the other configs (``warmstart_config``: the warm
  start's ``WarmstartConfig``; ``BootstrapConfig`` comes from a ``TrainConfig``).
* ``checks``: ``check_inputs``, which opens the files a config names before any work starts.
* ``describe``: the config as a person reads it (``trace config``): YAML that reads back
  unchanged, and every field with its default, what it may be and what it does.
"""

from trace_rl.config.checks import check_inputs, check_policy, check_split
from trace_rl.config.hashing import HASHED_UNLESS_DEFAULT, NEVER_HASHED, config_hash
from trace_rl.config.load import (config_from_mapping, load_config, load_settings,
                                  warmstart_config, warmstart_defaults)
from trace_rl.config.model import (ConfigError, NoOptions, TrainConfig, concerns, flat_name,
                                   flatten, options_model)
from trace_rl.config.sections import (CONCERNS, FIELDS, LOSS_AGGREGATIONS, SECTIONS, Section,
                                      family_fields, fields)

__all__ = ["CONCERNS", "FIELDS", "HASHED_UNLESS_DEFAULT", "LOSS_AGGREGATIONS", "NEVER_HASHED",
           "SECTIONS", "ConfigError", "NoOptions", "Section", "TrainConfig", "check_inputs",
           "check_policy", "check_split", "concerns", "config_from_mapping", "config_hash",
           "family_fields", "fields", "flat_name", "flatten", "load_config", "load_settings",
           "options_model", "warmstart_config", "warmstart_defaults"]
