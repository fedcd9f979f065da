"""Names and places of the BFCL family."""

from __future__ import annotations

from pathlib import Path

FAMILY = "bfcl"
BFCL_DIR = Path("function_calling") / "bfcl"
SINGLE_TURN = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
               "live_multiple", "live_parallel", "live_parallel_multiple")
IRRELEVANCE = ("irrelevance", "live_irrelevance", "live_relevance")
MULTI_TURN = ("multi_turn_base",)
CATEGORIES = SINGLE_TURN + IRRELEVANCE + MULTI_TURN
BFCL_EVAL_HINT = "pip install --no-deps bfcl-eval==2026.3.23"
