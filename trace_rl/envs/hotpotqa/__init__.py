"""``hotpotqa``: multi-hop QA with a BM25 ``search`` tool (``env``), graded by token F1 as the
official HotpotQA evaluation normalises answers (``metrics``); the warm start's ReAct traces of
its training items (``warmstart``)."""

from __future__ import annotations

from pathlib import Path

from trace_rl.envs.hotpotqa.warmstart import hotpotqa_trace
from trace_rl.envs.registry import Warmstart, family


def data_files(data_dir: Path | None) -> list[tuple[Path, str]]:
    """Every split's question file and pooled corpus, under ``multihop_qa/``
    (``HotpotQAEnv.load``)."""
    from trace_rl.envs.hotpotqa.env import SPLITS

    return [(Path("multihop_qa") / f, split) for split, files in SPLITS.items() for f in files if f]


# Train/dev splits, and a turn cap that holds a bad search, two hops and the answer (the warm
# start's recovery traces); tests/test_real_data.py measures the gold turns against max_new_tokens.
@family("hotpotqa", defaults={"train_split": "train", "eval_split": "dev", "max_new_tokens": 128,
                              "max_turns": 5},
        data_files=data_files, warmstart=Warmstart(trace=hotpotqa_trace))
def make(**kwargs):
    from trace_rl.envs.hotpotqa.env import HotpotQAEnv

    return HotpotQAEnv(**kwargs)
