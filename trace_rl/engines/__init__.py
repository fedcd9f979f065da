"""Rollout engines behind the ``Engine`` protocol (trace_rl.rollout.types), and their registry.

``make_engine(kind, model_dir, **opts)`` builds one; ``get_engine`` returns a process-wide cached
one, so flows and tasks pay an engine's start-up (vLLM: ~20 s on CPU) once per process and then
call ``load_weights`` after each policy update. ``default_engine_kind(device)`` picks vLLM,
the faster engine where it was measured (docs/results.md, "Engines benchmark").
"""

from __future__ import annotations

import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from trace_rl.engines import lifecycle
from trace_rl.engines.lifecycle import engine_scope, entry_point
from trace_rl.rollout.types import Engine


def _lazy(module: str, cls: str) -> Callable[..., Engine]:
    """The constructor ``cls`` of ``trace_rl.engines.<module>``, imported when first called:
    listing the engine kinds (a config check) must not import torch or vLLM."""
    def build(*args: Any, **kwargs: Any) -> Engine:
        import importlib

        return getattr(importlib.import_module(f"trace_rl.engines.{module}"), cls)(*args, **kwargs)

    return build


ENGINES: dict[str, Callable[..., Engine]] = {"hf": _lazy("hf", "HFEngine"),
                                             "vllm": _lazy("vllm_engine", "VLLMEngine")}
"""Engine kind -> constructor ``(model_dir, **opts)``."""


def __getattr__(name: str) -> Any:
    """``HFEngine`` and ``VLLMEngine``, imported on first use (module ``__getattr__``, PEP 562)."""
    if name == "HFEngine":
        from trace_rl.engines.hf import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from trace_rl.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

DEFAULT_ENGINE: dict[str, str] = {"cpu": "vllm", "cuda": "vllm"}
"""Device -> default engine kind, from bench/engines.py: vLLM because on this 2-core CPU machine
it generated 4.4x (tiny preset) and 4.8x (SmolLM2-135M) the tokens/s of the transformers engine
on the same 32-sample batches. Its start-up (20-65 s here) is paid once
per process; short tests that build engines should ask for "hf" explicitly. CUDA: vLLM by design,
to be confirmed by the same benchmark on a GPU machine."""

STARTUP_HINT: dict[str, str] = {"vllm": "20-65 s on this project's 2-core CPU machine"}
"""What an engine's start-up costs, as measured by bench/engines.py."""

_CACHE: dict[tuple, Engine] = {}
_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()
"""Every engine ``make_engine`` built and nobody closed yet, cached or not (``close_engines``)."""

SPAWNS_PROCESSES = {"vllm"}
"""Engine kinds that run in child processes: the first one started also starts the reaper
(``trace_rl.engines.lifecycle.watch_children``)."""


def context_limit(model_dir: str | Path) -> int:
    """Tokens of prompt + generation that every engine serves for ``model_dir``: the engines'
    ``MAX_MODEL_LEN`` (vLLM's ``max_model_len``), or the model's own ``max_position_embeddings``
    when smaller. A longer prompt would abort a whole vLLM batch, so callers skip such items
    (``tasks.runtime.items_for``) and cap each episode at this (``run_episodes(max_context=)``)."""
    import json

    from trace_rl.engines.vllm_engine import MAX_MODEL_LEN

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(MAX_MODEL_LEN, int(config.get("max_position_embeddings") or MAX_MODEL_LEN))


def make_engine(kind: str, model_dir: str | Path, **opts: Any) -> Engine:
    """A new engine of ``kind`` ("hf" | "vllm") serving the HF directory ``model_dir``."""
    if kind not in ENGINES:
        raise ValueError(f"make_engine: unknown engine kind {kind!r}; choose one of {sorted(ENGINES)}")
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"make_engine: {model_dir} is not a Hugging Face model directory "
                                "(no config.json)")
    if kind in SPAWNS_PROCESSES:
        lifecycle.watch_children()
    engine = ENGINES[kind](model_dir, **opts)
    _LIVE.add(engine)
    lifecycle.keep_exit_hook_first()  # after whatever the engine's start-up imported
    return engine


def get_engine(kind: str, model_dir: str | Path, **opts: Any) -> Engine:
    """The process-wide engine for (kind, model_dir, opts), created on first use.

    Later weight updates go through ``engine.load_weights(new_dir)``; the cache key stays the
    directory the engine was started from.
    """
    key = (kind, str(Path(model_dir).resolve()), tuple(sorted(opts.items())))
    if key not in _CACHE:
        # Announced: vLLM's start-up is the longest silent-looking wait of a run after the bootstrap.
        print(f"starting the {kind} rollout engine on {model_dir} "
              f"({STARTUP_HINT.get(kind, 'a few seconds')}, once per process)", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        _CACHE[key] = make_engine(kind, model_dir, **opts)
        print(f"{kind} rollout engine ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    return _CACHE[key]


def close_engines() -> None:
    """Close every engine of this process, cached or not. Run when the outermost
    ``engine_scope`` ends and at interpreter exit, before ``multiprocessing`` joins the engine
    processes (``trace_rl.engines.lifecycle``)."""
    _CACHE.clear()
    for engine in list(_LIVE):
        _LIVE.discard(engine)
        engine.close()


def default_engine_kind(device: str | None = None) -> str:
    """The engine kind measured fastest on ``device`` ("cpu" | "cuda"; default: this machine's)."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device.split(":")[0]
    if device not in DEFAULT_ENGINE:
        raise ValueError(f"default_engine_kind: unknown device {device!r}; "
                         f"choose one of {sorted(DEFAULT_ENGINE)}")
    return DEFAULT_ENGINE[device]


__all__ = ["DEFAULT_ENGINE", "ENGINES", "HFEngine", "VLLMEngine", "close_engines",
           "default_engine_kind", "engine_scope", "entry_point", "get_engine", "make_engine"]
