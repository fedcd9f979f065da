"""Function calling on BFCL v4 ($TRACE_DATA_DIR/function_calling/bfcl), plus a generic adapter that
turns any OpenAI-style tool list and Python callables into an environment.

Single-turn categories (simple_python, multiple, parallel, parallel_multiple and their live_*
versions) are graded by an AST/structural match against ``possible_answer``, with BFCL's rules,
re-implemented here:

* the call count must match; parallel calls match in any order (an exact bipartite matching,
  where BFCL matches greedily: a strict improvement that only differs when one call could match
  several expected ones);
* the function name must match (a dotted name may be written with ``_`` for ``.``, as
  OpenAI-style names cannot hold dots, unless that spelling names another listed function);
* required parameters present, no parameter outside the schema or the possible answer, and every
  possible-answer parameter present unless ``""`` is among its acceptable values (optional);
* types per the schema: ``float`` accepts an int, ``tuple`` a list, ``any`` means string, a bool
  is never an int; a value of the possible answer's own type is accepted as a variable reference
  and then compared exactly; arrays are type-checked one level deep;
* values: one of the acceptable values; strings compared after BFCL's standardisation (drop
  spaces and ``,./-_*^``, lower case, ``'`` -> ``"``), also inside lists and dicts; dicts key by
  key (missing keys allowed when ``""`` is acceptable for them); lists of dicts element-wise.

Irrelevance categories (irrelevance, live_irrelevance): correct when the answer holds no call
(an answer that does not parse as calls counts as no call, as in BFCL). live_relevance: correct
when at least one call parses.

**Answer representation (single turn).** One turn, ending with ``<answer>`` holding the calls:
a JSON list of ``{"name": ..., "arguments": {...}}`` (``[]`` for no call), or BFCL's Python
syntax ``[f(a=1), g(b='x')]``. The prediction file of ``trace score`` may give ``calls`` as that
list directly.

**Multi-turn (multi_turn_base).** The item's user turns arrive one by one: the agent makes
``<tool_call>`` turns, executed on the bfcl-eval package's simulated backends (file system,
messaging, trading, travel, ...), ends each user turn by calling the extra tool
``next_request()`` (its observation is the next user message), and ends the episode with
``<answer>`` after the last one (an answer always ends an episode in the ReAct loop). The family is
stateful: the state at a prefix is the initial configuration plus a replay of the stored tool
calls (``restore``); backends are seeded, so a replay reproduces the live state exactly. Grading (``verify_final``) re-executes the
calls made in each user turn, and the ground truth's, on fresh backends and applies bfcl-eval's
own ``state_checker`` and ``response_checker`` after each turn (BFCL's multi-turn checker, minus
its module-global instance cache). For ``trace score`` a multi-turn prediction gives ``calls`` as
a list with one list of calls per user turn.

bfcl-eval pins numpy 1.26 and pulls in API clients, so it is installed with
``pip install --no-deps bfcl-eval==2026.3.23``: the backends need only the standard library and
mpmath. Single-turn grading does not need it.

The package is split by concern: ``calls`` (tool schemas, parsing an answer into calls),
``grader`` (the single-turn match), ``backends`` (multi-turn execution and checking), ``data``
(loading category files and one's own files, and the files of the data directory), ``env``
(``BFCLEnv``) and ``warmstart`` (the warm start's traces). The names below are the family's
public surface; the family registers at the end.
"""

from trace_rl.envs.bfcl.backends import Backends, MultiTurnState, grade_multi_turn, gt_call
from trace_rl.envs.bfcl.calls import (
                                      CallParseError,
                                      from_json_schema,
                                      openai_tool,
                                      parse_calls,
                                      parse_python_call,
                                      to_json_schema,
)
from trace_rl.envs.bfcl.constants import (
                                      BFCL_DIR,
                                      BFCL_EVAL_HINT,
                                      CATEGORIES,
                                      FAMILY,
                                      IRRELEVANCE,
                                      MULTI_TURN,
                                      SINGLE_TURN,
)
from trace_rl.envs.bfcl.data import category_of, data_files, load_bfcl_file, load_fncall_file
from trace_rl.envs.bfcl.env import BFCLConfig, BFCLEnv
from trace_rl.envs.bfcl.grader import (
                                      FILE_CATEGORY,
                                      GRADERS,
                                      MATCH_MODES,
                                      answer_contradictions,
                                      gold_calls,
                                      gold_value,
                                      grade_single_turn,
                                      match_call,
                                      match_calls,
                                      standardize,
)
from trace_rl.envs.bfcl.warmstart import bfcl_trace
from trace_rl.envs.registry import Warmstart, family

__all__ = [
    "BFCL_DIR", "BFCL_EVAL_HINT", "CATEGORIES", "FAMILY", "FILE_CATEGORY", "GRADERS", "IRRELEVANCE",
    "MATCH_MODES", "MULTI_TURN", "SINGLE_TURN", "BFCLConfig", "BFCLEnv", "Backends",
    "CallParseError", "MultiTurnState", "answer_contradictions", "category_of",
    "from_json_schema", "gold_calls", "gold_value", "grade_multi_turn", "grade_single_turn",
    "gt_call", "load_bfcl_file", "load_fncall_file", "match_call", "match_calls", "openai_tool",
    "parse_calls", "parse_python_call", "standardize", "to_json_schema",
]

WARMSTART = Warmstart(trace=bfcl_trace, settings={
    "train_split": "live_simple", "eval_split": "simple_python", "env_args": (), "recovery": 0.0,
    "bridge_thoughts": False, "question_first": False, "epochs": 1, "max_turns": 2,
    "max_new_tokens": 256})
"""Traces of ``live_simple`` (258 real user requests, median 506 tokens with SmolLM2's
tokenizer), measured on ``simple_python`` as ``trace train family=bfcl`` evaluates; one turn
answers an item, in at most 256 tokens; no search settings, recovery traces or bridge thoughts.
Not ``multiple``: 96 of the first 100 ``simple_python`` questions are among its questions (the
split check refuses it); ``live_multiple`` doubles the traces (1053 more, median over 1000
tokens) and the SFT time."""


# Trains on live_simple and evaluates on simple_python; tests/test_real_data.py measures the gold
# turns against max_new_tokens.
@family("bfcl", defaults={"train_split": "live_simple", "eval_split": "simple_python",
                          "max_new_tokens": 256},
        data_files=data_files, warmstart=WARMSTART)
def make(**kwargs) -> BFCLEnv:
    return BFCLEnv(**kwargs)
