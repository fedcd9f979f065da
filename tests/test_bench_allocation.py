"""bench.allocation on a small, fast configuration: equal budgets, well-formed output, sane ordering."""

import re

import numpy as np
import pytest
import torch

from bench.allocation import BenchConfig, format_table, headline, main, run_bench
from trace_core.tree import backup, sibling_contrast_pairs


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_sibling_contrast_pairs_hand_worked():
    # root -> a (leaf 1), b (leaf 0), c -> (leaf 1, leaf 0): V^ = [2/4, 1, 0, 1/2, 1, 0].
    parent = np.array([-1, 0, 0, 0, 3, 3])
    reward = np.array([np.nan, 1, 0, np.nan, 1, 0])
    value, _ = backup(parent, reward)
    # Root's children {1, 0, 0.5}: 3 differing pairs; c's children {1, 0}: 1 pair.
    assert sibling_contrast_pairs(parent, value) == 4
    # Equal siblings make no pair: root -> three leaves 1, 1, 0 gives 2 pairs.
    parent = np.array([-1, 0, 0, 0])
    value, _ = backup(parent, np.array([np.nan, 1, 1, 0]))
    assert sibling_contrast_pairs(parent, value) == 2


def test_small_bench_spends_equal_budgets_and_ranks_oracle_first(one_thread):
    cfg = BenchConfig(steps=6, roots=32, multiplier=2, dataset_size=400, pool_size=128, eval_prompts=80)
    result = run_bench(cfg)
    assert set(result.figures) == set(cfg.methods)
    for name, fig in result.figures.items():
        if name == "dapo":  # stops early once its batch holds enough mixed groups
            assert fig["leaves_per_step"] <= cfg.budget.total
        else:
            assert fig["leaves_per_step"] == cfg.budget.total, name
        # The effective ratio is mixed roots over roots: a whole number of mixed roots, at least
        # one over the run for every method, and mixed roots are mixed anchors too.
        mixed_roots = fig["effective_ratio"] * fig["roots_per_step"] * cfg.steps
        assert mixed_roots == pytest.approx(round(mixed_roots)) and round(mixed_roots) >= 1, name
        assert fig["mixed_anchor_share"] > 0, name
    fig = result.figures
    # Uniform sampling sits near the simulator's 25-35% design point; the oracle is far above.
    assert fig["oracle"]["effective_ratio"] > 2 * fig["grpo"]["effective_ratio"]
    assert fig["trace"]["effective_ratio"] > fig["grpo"]["effective_ratio"]
    # Trees re-use prefixes, so they generate fewer tokens than flat groups at equal leaves.
    assert fig["random_prefix"]["tokens_per_step"] < fig["grpo"]["tokens_per_step"]
    for name, stats in result.predictor.items():
        assert stats["brier"] < stats["brier_constant"], name
    table = format_table(result)
    assert all(name in table for name in cfg.methods)
    assert re.fullmatch(r"TRACE effective ratio: \d+\.\d\dx GRPO, \d+\.\d\dx oracle", headline(result))


def test_cli_prints_table_and_headline_last(one_thread, capsys):
    main(["--steps", "2", "--roots", "16", "--multiplier", "1", "--pool", "64", "--seed", "3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("allocation bench: steps=2 seed=3 M=16 N=1 leaves/step=32")
    assert re.fullmatch(r"TRACE effective ratio: \d+\.\d\dx GRPO, \d+\.\d\dx oracle", out[-1])
