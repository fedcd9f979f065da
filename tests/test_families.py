"""A family is one folder, registered once: the contract every registered family meets (items,
grading, tools, defaults, and each capability it registers), checked on the shipped fixtures; and
a family added in a test as one folder, found, validated by the config and trained one step
through the real train flow."""

from __future__ import annotations

import random
import re
import sys
import textwrap
from pathlib import Path

import pytest

import trace_rl.envs
from data_dirs import FIXTURES
from trace_rl.config import FIELDS, TrainConfig, config_from_mapping, family_fields
from trace_rl.envs import registry
from trace_rl.envs.base import Action, Environment, TaskItem, Verdict
from trace_rl.envs.datadir import check_data_dir
from trace_rl.envs.registry import families, make_env, spec

ENVS = Path(trace_rl.envs.__file__).parent
WRONG = "zq-not-an-answer"
"""An answer no item of any family has."""


@pytest.fixture(autouse=True)
def _fixtures(monkeypatch):
    """The real families read the shipped fixtures: the contract is checked on them."""
    monkeypatch.setenv("TRACE_DATA_DIR", str(FIXTURES))


def _sandbox_or_skip(exc: Exception) -> None:
    from trace_rl.sandbox import SandboxUnavailable

    if isinstance(exc, SandboxUnavailable):
        pytest.skip(f"this machine cannot build the sandbox: {exc}")
    raise exc


def run_actions(env: Environment, item: TaskItem, actions: list[Action]) -> float:
    """The reward of an episode that takes ``actions`` (the last one the answer), tools run."""
    try:
        state = env.reset(item)
    except Exception as exc:  # noqa: BLE001 (only the sandbox's refusal skips)
        _sandbox_or_skip(exc)
    for action in actions[:-1]:
        assert not env.step(state, action).done
    return env.verify_final(item, state, actions[-1].answer).reward


def check_contract(name: str, n_items: int = 3) -> None:
    """What the pipeline asks of family ``name``: a folder of its name, defaults that are config
    fields and whose splits load, tools in the OpenAI format named in the prompt, items of its
    own, an expert that scores 1 where a wrong answer scores 0 (also after a restore by replay),
    and each registered capability usable."""
    family = spec(name)
    module = family.factory.__module__
    assert module.rpartition(".")[2] == name, module
    assert set(family.defaults) <= set(FIELDS), family.defaults
    own = family.options.model_fields if family.options else {}  # its Settings model
    assert all(len(f.description or "") > 10 for f in own.values()), own
    assert {n for n, (f, _) in family_fields().items() if f == name} == set(own)  # flat names
    cfg = config_from_mapping({"family": name})
    env = make_env(name, **cfg.env_kwargs())
    assert env.family == name

    tools = env.tools()
    names = [t["function"]["name"] for t in tools]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object"
               for t in tools) and len(set(names)) == len(names), tools
    assert all(n in env.system_prompt() for n in names)

    train, held = env.load(cfg.train_split), env.load(cfg.eval_split)
    assert train and held, (cfg.train_split, cfg.eval_split)
    for items in (train, held):
        assert len({it.id for it in items}) == len(items)
        assert all(it.family == name and it.question for it in items)
    assert all(env.user_prompt(it) for it in train[:n_items])

    for item in train[:n_items]:
        actions = list(env.expert_actions(item))
        assert actions[-1].kind == "answer" and all(a.kind == "tool" for a in actions[:-1])
        assert run_actions(env, item, actions) == 1.0, item.id
        assert run_actions(env, item, [Action(kind="answer", answer=WRONG)]) == 0.0, item.id
        if len(actions) > 1:  # a continuation from the state before the answer
            state = env.restore(item, actions[:-1], [None] * (len(actions) - 1))
            assert env.verify_final(item, state, actions[-1].answer).reward == 1.0

    if family.generated:
        assert "difficulty" in cfg.env_kwargs()
    if family.bootstrap is not None:
        assert family.generated  # the bootstrap sizes its own SFT and report splits
        think = family.bootstrap.thoughts
        for item in train[:n_items]:
            actions = list(env.expert_actions(item))
            said = think(item, actions) if think else [""] * len(actions)
            assert len(said) == len(actions) and all(isinstance(s, str) for s in said)
        from trace_rl.policy.bootstrap import family_config

        family_config(name, difficulty=1, preset="tiny", seed=0, sft_examples=None,
                      sft_epochs=None, target_success=(0.3, 0.7))
    if family.warmstart is not None:
        from trace_rl.config import warmstart_config

        recipe = warmstart_config([f"family={name}"])
        built = 0
        for item in env.load(recipe.train_splits[0])[:n_items]:
            made = family.warmstart.trace(env, item, random.Random(0), False, recipe)
            if made is not None:
                actions, said = made
                assert len(said) == len(actions) and run_actions(env, item, actions) == 1.0
                built += 1
        assert built, f"{name}: the trace builder gave no trace of {recipe.train_splits[0]}"
    if family.data_files is not None:
        files, missing = check_data_dir(FIXTURES, [name])[name]
        assert files and not missing, missing
        assert {cfg.train_split, cfg.eval_split} <= {s for f in files for s in f.splits}


def test_every_folder_of_the_package_is_one_registered_family_of_its_name():
    folders = sorted(p.name for p in ENVS.iterdir() if (p / "__init__.py").is_file())
    assert families() == folders == ["bfcl", "hotpotqa", "math", "synth_arith", "synth_chain",
                                     "synth_fncall", "synth_lookup"]
    with pytest.raises(ValueError, match="lives in the folder of its name"):
        registry.family("other_name")(lambda **kw: None)
    with pytest.raises(KeyError, match="unknown task family 'nope'; registered: bfcl"):
        spec("nope")


def test_capabilities_are_registered_not_read_from_names():
    """What differs between families comes from their registration: the code tests no name."""
    assert {f for f in families() if spec(f).bootstrap} == \
        {f for f in families() if spec(f).generated} == {f for f in families() if f.startswith("synth_")}
    assert {f for f in families() if spec(f).warmstart} == {"hotpotqa", "bfcl"}
    assert {f for f in families() if spec(f).data_files} == {"hotpotqa", "math", "bfcl"}
    assert {f for f in families() if spec(f).score_by_replay} == {"synth_fncall"}
    code = [p for top in ("trace_rl", "tasks", "flows", "cli", "deployments")
            for p in (ENVS.parents[1] / top).rglob("*.py")
            if ENVS not in p.parents and p.name != "registry.py"]
    tests = re.compile(r"family\s*(==|!=)\s*['\"]|family\s+(not\s+)?in\s+\(['\"]|"
                       r"\.startswith\(['\"]synth_|\{['\"](synth_\w+|hotpotqa|bfcl|math)['\"]:")
    found = [f"{p}: {m.group(0)}" for p in code for m in tests.finditer(p.read_text())]
    assert not found, found


def test_every_family_has_one_row_in_the_docs_table():
    text = (ENVS.parents[1] / "docs" / "families.md").read_text(encoding="utf-8")
    table = text[text.index("| family (`trace_rl/envs/<family>/`)"):].split("\n\n")[0]
    rows = re.findall(r"^\| `(\w+)`", table, re.M)
    assert sorted(rows) == families() and len(rows) == len(set(rows))


@pytest.mark.parametrize("name", sorted(p.name for p in ENVS.iterdir() if (p / "__init__.py").is_file()))
def test_every_registered_family_meets_the_contract(name):
    check_contract(name)


def test_the_contract_fails_a_family_that_breaks_it(monkeypatch):
    """The contract can fail: an arith whose verifier accepts anything does not pass it."""
    from trace_rl.envs.synth_arith.env import SynthArith

    monkeypatch.setattr(SynthArith, "verify", lambda self, item, answer: Verdict(1.0))
    with pytest.raises(AssertionError):
        check_contract("synth_arith")


# ---- a new family: one folder, registered once ----------------------------------------------

ECHO = '''
"""``synth_echo``: reverse a word with the ``reverse`` tool and answer it (a family of a test)."""

from trace_rl.envs.base import Action, Environment, TaskItem, ToolError, Verdict
from trace_rl.envs.prompt import system_prompt
from trace_rl.envs.registry import family

WORDS = {"train": ["apple", "river", "stone", "cloud", "maple", "tiger"], "test": ["lemon", "piano"]}
REVERSE = {"type": "function", "function": {
    "name": "reverse", "description": "The text written backwards.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}


class Echo(Environment):
    family = "synth_echo"
    max_turns = 3

    def load(self, split, limit=None):
        if split not in WORDS:
            raise ValueError(f"synth_echo has no split {split!r}; its splits: train, test")
        return [TaskItem(f"{split}-{w}", self.family, f"Reverse the word {w}.", w[::-1])
                for w in WORDS[split]][:limit]

    def tools(self):
        return [REVERSE]

    def system_prompt(self):
        return system_prompt("Reverse the word with the tool, then answer.", self.tools())

    def reset(self, item):
        return None

    def call_tool(self, state, name, arguments):
        if name != "reverse" or not isinstance(arguments.get("text"), str):
            raise ToolError("call reverse(text)")
        return arguments["text"][::-1]

    def verify(self, item, answer):
        return Verdict(float(str(answer).strip() == item.gold))

    def expert_actions(self, item):
        word = item.question.split()[-1].rstrip(".")
        return [Action(kind="tool", tool="reverse", arguments={"text": word}),
                Action(kind="answer", answer=item.gold)]


@family("synth_echo", defaults={"train_split": "train", "eval_split": "test", "max_turns": 3})
def make(**kwargs):
    return Echo(**kwargs)
'''


@pytest.fixture
def echo_family(tmp_path, monkeypatch):
    """``synth_echo`` as one folder outside the repository, on the package's search path; the
    registry, the path and the imported module are restored afterwards."""
    folder = tmp_path / "families" / "synth_echo"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(textwrap.dedent(ECHO))
    monkeypatch.setattr(trace_rl.envs, "__path__", [*trace_rl.envs.__path__, str(folder.parent)])
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_FOUND", set(registry._FOUND))
    yield "synth_echo"
    sys.modules.pop("trace_rl.envs.synth_echo", None)


def test_a_new_family_is_one_folder_found_by_the_registry_and_the_config(echo_family):
    assert "synth_echo" not in registry._FAMILIES  # nothing registered it by name
    assert echo_family in families()
    with pytest.raises(ValueError, match="family='synth_nope'.* 'synth_echo', 'synth_fncall'"):
        config_from_mapping({"family": "synth_nope"})
    cfg = config_from_mapping({"family": echo_family})
    assert (cfg.train_split, cfg.eval_split, cfg.max_turns) == ("train", "test", 3)
    assert TrainConfig.model_json_schema()["properties"]["family"]["enum"] == families()
    check_contract(echo_family)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.timeout(900)
def test_a_new_family_trains_one_step_through_the_train_flow(echo_family, tiny_model_dir, tmp_path):
    """The folder alone: the real train flow rolls it out (a scripted engine writes the turns:
    the tool call, then the right reversal or, for half the request seeds, the word itself),
    grades it, stores its trees and updates the policy."""
    from flows.train import train
    from scripted_engine import question_of, scripted_rollouts, uniform
    from trace_rl.rollout.format import render_action
    from trace_rl.storage.store import TreeStore

    def respond(context: str, j: int, seed: int | None) -> str:
        word = question_of(context).split()[-1].rstrip(".")
        if "<|im_start|>tool" not in context:
            return render_action(Action(kind="tool", tool="reverse", arguments={"text": word}))
        right = uniform("echo", seed, j) < 0.5
        return render_action(Action(kind="answer", answer=word[::-1] if right else word))

    cfg = {"family": echo_family, "policy": str(tiny_model_dir), "engine": "hf", "steps": 1,
           "root_budget": 4, "pool_size": 4, "multiplier": 1, "max_new_tokens": 48,
           "eval_items": 0, "plot_every": 0}
    with scripted_rollouts(respond) as engines:
        summary = train(config=cfg, workdir=str(tmp_path / "run"))
    assert engines and summary["run_id"].startswith("trace-default-")
    store = TreeStore(tmp_path / "run" / "trace.duckdb", create=False)
    leaves = store.query("SELECT item_id, reward FROM nodes WHERE is_leaf").to_pylist()
    assert leaves and {r["item_id"].split("-")[0] for r in leaves} == {"train"}
    assert {r["reward"] for r in leaves} == {0.0, 1.0}
    m = summary["last_metrics"]
    assert m["rollout/leaves"] == len(leaves) and m["loss/paths"] > 0
