"""Math family: every gold answer of every math file scores 1 and a wrong number scores 0 under
math-verify; the Python tool works through the sandbox; restore by replay equals the live state.

The data is the full set when TRACE_DATA_DIR holds it, else the fixtures (tests/data_dirs.py);
the full files' sizes are checked where they are present (``full_data``)."""

from __future__ import annotations

import re

import pytest

from data_dirs import FULL_DATA
from trace_rl.envs.base import DatasetError, ToolError
from trace_rl.envs.math.env import SPLITS, MathEnv, grade, gsm8k_gold, load_math_file
from trace_rl.sandbox import SandboxLimits
from trace_rl.rollout.types import Action


def corrupt(gold: str) -> str:
    """A wrong answer: the first digit bumped by one (so the shape stays plausible), or a number
    that no answer in these sets equals when there is no digit."""
    m = re.search(r"\d", gold)
    if m is None:
        return "-987654321"
    return gold[:m.start()] + str((int(m.group()) + 1) % 10) + gold[m.end():]


@pytest.mark.parametrize("split", ["gsm8k_test", "math500", "aime2024"])
def test_gold_scores_one_and_corrupted_zero_all_rows(split):
    env = MathEnv()
    items = env.load(split)
    assert items
    wrong_gold = [it.id for it in items if env.verify(it, it.gold).reward != 1.0]
    assert wrong_gold == []
    wrong_corrupt = [(it.id, it.gold) for it in items if env.verify(it, corrupt(it.gold)).reward != 0.0]
    assert wrong_corrupt == []


@pytest.mark.slow
def test_gsm8k_train_all_rows():
    """The largest file, every row (the full file's 7473 take ~25 s on a busy 2-core box)."""
    env = MathEnv()
    items = env.load("train")
    assert items
    assert [it.id for it in items if env.verify(it, it.gold).reward != 1.0] == []
    assert [it.id for it in items if env.verify(it, corrupt(it.gold)).reward != 0.0] == []


@pytest.mark.full_data("math")
def test_full_files_have_every_row():
    env = MathEnv(data_dir=FULL_DATA)
    sizes = {split: len(env.load(split)) for split in SPLITS}
    assert sizes == {"train": 7473, "test": 1319, "gsm8k_train": 7473, "gsm8k_test": 1319,
                     "math500": 500, "aime2024": 30}


def test_answer_forms():
    assert gsm8k_gold("... so she pays\n#### 1,450,000") == "1450000"
    assert grade("1450000", "1,450,000", "gsm8k").reward == 1.0
    assert grade("18", "The answer is \\boxed{18}.", "gsm8k").reward == 1.0
    assert grade("\\frac{1}{2}", "0.5", "math500").reward == 1.0
    assert grade("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", "math500").reward == 1.0
    assert grade("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/3)", "math500").reward == 0.0
    assert grade("18", "", "gsm8k").reward == 0.0
    assert grade("18", None, "gsm8k").reward == 0.0


def test_ids_follow_files():
    env = MathEnv()
    assert env.load("test", 2)[1].id == "gsm8k_test:2"
    assert env.load("math500", 1)[0].id == "test/precalculus/807.json"
    assert env.load("aime2024", 1)[0].id.startswith("2024-")


def test_malformed_rows_name_file_and_line(tmp_path):
    bad = tmp_path / "gsm8k_bad.jsonl"
    bad.write_text('{"question": "q", "answer": "x\\n#### 3"}\n{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(DatasetError, match=r"gsm8k_bad.jsonl:2: .*####"):
        load_math_file(bad)
    aime = tmp_path / "aime.jsonl"
    aime.write_text('{"id": "a", "problem": "p", "answer": "seven"}\n')
    with pytest.raises(DatasetError, match=r"aime.jsonl:1: .*integer"):
        load_math_file(aime)


@pytest.mark.slow  # waits out a 10 s wall limit
def test_python_tool_and_errors():
    # 10 s of wall time: a new box must start and print within it on a loaded machine; the
    # endless sleep still times out
    env = MathEnv(limits=SandboxLimits(cpu_seconds=1, wall_seconds=10))
    item = env.load("test", 1)[0]
    state = env.reset(item)
    assert env.call_tool(state, "python", {"code": "print(sum(range(10)))"}) == "45"
    assert "ZeroDivisionError" in env.call_tool(state, "python", {"code": "1/0"})
    assert "timed out" in env.call_tool(state, "python", {"code": "import time\ntime.sleep(30)"})
    out = env.call_tool(state, "python", {"code": "print(open('/etc/passwd').read())"})
    assert "FileNotFoundError" in out and "root:" not in out  # the host's /etc is not in the box
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool(state, "bash", {"code": "ls"})
    with pytest.raises(ToolError, match="code"):
        env.call_tool(state, "python", {})
    step = env.step(state, Action(kind="tool", tool="python", arguments={"cmd": 1}))
    assert step.error and not step.done


def test_restore_by_replay_equals_live():
    env = MathEnv()
    item = env.load("test", 5)[4]
    actions = env.expert_actions(item)
    assert actions[0].kind == "tool" and actions[-1].kind == "answer"
    state = env.reset(item)
    observations = [env.step(state, a).observation for a in actions]
    assert observations[-1] is None
    restored = env.restore(item, actions[:1], observations[:1])
    assert restored == state
    # a continuation from the stored prefix sees what the live run saw
    assert env.step(restored, actions[0]).observation == observations[0]
    assert env.verify(item, actions[-1].answer).reward == 1.0
