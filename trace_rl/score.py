"""``trace score``: grade a JSONL of predictions with the verifiers that training uses.

    trace score --task FAMILY --data FILE --predictions FILE
    python -m trace_rl.score --task FAMILY --data FILE --predictions FILE

The data file is loaded by the family itself (``make_env(FAMILY, **env_args).load(FILE)``), so
any file the family reads works (for the synthetic families, a file written by their ``save``,
scored with the same ``--env-arg difficulty=N`` it was made with). Each
prediction line is ``{"id": ..., "answer": ...}`` or ``{"id": ..., "calls": [...]}``:

* ``answer``: the text that would sit in ``<answer>…</answer>``; graded by ``env.verify``.
* ``calls``: for BFCL single-turn the list of ``{"name", "arguments"}`` calls; for BFCL
  multi-turn one such list per user turn; for a family graded on its final state (e.g.
  ``synth_fncall``) the tool calls, replayed in order through the family's tools and then graded
  by ``env.verify_final`` on the state they leave.

Ids follow the data file's own id field (``id``, ``_id``, ``idx``, ``unique_id``); for files
without one (GSM8K) the 1-based row number, given bare (``12``) or as the item id
(``gsm8k_test:12``). Output: one ``<id>\\t<reward>`` line per prediction, in file order, then
``mean reward: <x>`` as the last line (the mean over the predictions given). A malformed line, an
unknown or repeated id, a line with neither ``answer`` nor ``calls``, bytes that are not UTF-8,
or an empty file is an error naming the file (predictions or data) and line; the exit status
is then 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from trace_rl.envs.base import DatasetError, Environment, TaskItem
from trace_rl.envs.io import check_text_file, text_lines
from trace_rl.envs.registry import families, make_env, spec
from trace_rl.rollout.types import Action, Verdict


def _by_answer(env: Environment, item: TaskItem, pred: Mapping[str, Any]) -> Verdict:
    if "calls" not in pred and pred["answer"] is None:  # the episode gave no answer (trace eval)
        return Verdict(0.0, {"no_answer": 1.0})
    return env.verify(item, pred["calls"] if "calls" in pred else pred["answer"])


def _by_replay(env: Environment, item: TaskItem, pred: Mapping[str, Any]) -> Verdict:
    """Replay the predicted tool calls, then grade the final state (and the answer, if any)."""
    state = env.reset(item)
    for k, call in enumerate(pred.get("calls") or []):
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            raise ValueError(f"calls[{k}] must be an object with a string 'name'")
        env.step(state, Action(kind="tool", tool=call["name"], arguments=call.get("arguments") or {}))
    return env.verify_final(item, state, pred.get("answer"))


def _aliases(item: TaskItem) -> list[str]:
    names = [item.id]
    if "row" in item.meta:  # files without ids: the row number stands for the item
        names.append(str(item.meta["row"]))
    return names


def read_predictions(path: Path, items: Sequence[TaskItem]) -> list[tuple[int, TaskItem, dict[str, Any]]]:
    """(line, item, prediction) per predictions line; raises ``DatasetError`` naming file and
    line."""
    index: dict[str, TaskItem] = {}
    for it in items:
        for name in _aliases(it):
            index.setdefault(name, it)
    out, seen = [], {}
    for lineno, line in text_lines(path):  # a non-UTF-8 byte: an error naming file and line
        if not line.strip():
            continue
        try:
            pred = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(str(path), lineno, f"invalid JSON: {exc.msg} at column {exc.colno}")
        if not isinstance(pred, dict):
            raise DatasetError(str(path), lineno, "expected a JSON object")
        if "id" not in pred or not isinstance(pred["id"], (str, int)) or isinstance(pred["id"], bool):
            raise DatasetError(str(path), lineno, "missing or non-string/integer field 'id'")
        if "answer" not in pred and "calls" not in pred:
            raise DatasetError(str(path), lineno, "needs a field 'answer' or 'calls'")
        key = str(pred["id"])
        item = index.get(key)
        if item is None:
            raise DatasetError(str(path), lineno, f"unknown id {key!r}: not in the data file")
        if item.id in seen:
            raise DatasetError(str(path), lineno, f"id {key!r} repeats line {seen[item.id]}")
        seen[item.id] = lineno
        out.append((lineno, item, pred))
    if not out:
        raise DatasetError(str(path), 1, "no predictions: the file is empty")
    return out


def score(task: str, data: Path, predictions: Path, **env_kwargs: Any) -> list[tuple[str, Verdict]]:
    """(prediction id, verdict) per prediction line."""
    env = make_env(task, **env_kwargs)
    check_text_file(data)  # an empty or binary data file is named, with the line, up front
    items = env.load(str(data))
    if not items:
        raise DatasetError(str(data), 1, f"no {task} items in the data file")
    grade = _by_replay if spec(task).score_by_replay else _by_answer
    results = []
    for lineno, item, pred in read_predictions(predictions, items):
        try:
            verdict = grade(env, item, pred)
        except (ValueError, TypeError, KeyError) as exc:
            raise DatasetError(str(predictions), lineno, f"id {pred['id']!r}: {exc}") from exc
        results.append((str(pred["id"]), verdict))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; prints per-item rewards and ``mean reward: <x>`` last. Returns the exit
    status (0 ok, 2 bad input)."""
    parser = argparse.ArgumentParser(prog="trace score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help=f"family: {', '.join(families())}")
    parser.add_argument("--data", required=True, type=Path, help="the family's data file")
    parser.add_argument("--predictions", required=True, type=Path,
                        help='JSONL of {"id", "answer"} or {"id", "calls"}')
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument of the family (repeatable; VALUE read as JSON when "
                             "it parses), e.g. --env-arg difficulty=2 for a synthetic file")
    args = parser.parse_args(argv)
    env_kwargs: dict[str, Any] = {}
    for pair in args.env_arg:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            print(f"trace score: --env-arg {pair!r}: use KEY=VALUE", file=sys.stderr)
            return 2
        try:
            env_kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            env_kwargs[key] = value
    if args.task not in families():
        print(f"trace score: unknown --task {args.task!r}; choose one of {', '.join(families())}",
              file=sys.stderr)
        return 2
    for flag, path in (("--data", args.data), ("--predictions", args.predictions)):
        if not path.is_file():
            print(f"trace score: {flag} {path}: no such file", file=sys.stderr)
            return 2
    try:
        results = score(args.task, args.data, args.predictions, **env_kwargs)
    except (DatasetError, FileNotFoundError, ValueError, TypeError) as exc:
        print(f"trace score: {exc}", file=sys.stderr)
        return 2
    for pid, verdict in results:
        print(f"{pid}\t{verdict.reward:g}")
    mean = sum(v.reward for _, v in results) / len(results) if results else 0.0
    print(f"mean reward: {mean:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
