"""Transformers rollout engine: the reference engine in tests, and a CPU fallback for tiny models.

A hand-written incremental decode over a left-padded batch with a KV cache (``DynamicCache``):
every row (request x sample) is prefilled once, then decoded one token per step; rows that end
(EOS, a stop string, or ``max_tokens``) are dropped from the cache so the batch shrinks.

Semantics are chosen to match ``VLLMEngine`` token for token on a greedy decode:

* ``Completion.logprobs`` hold the *raw* model log-probability of each sampled token,
  log_softmax(logits) before temperature and top-p (vLLM's default ``logprobs_mode="raw_logprobs"``).
  At temperature 1 and top_p 1 this is exactly the behaviour policy's log-prob that RL needs; at
  other settings it is the untempered model's log-prob, not the sampling distribution's.
* A stop string is searched in the decoded generated text (special tokens skipped); the text is cut
  right after it and the tokens keep everything up to the token that completed it. EOS ends a turn
  with ``finish_reason="stop"``; the EOS token stays in ``token_ids`` (it was sampled, it is trained
  on) but not in ``text``.
* CPU threads: ``generate`` runs with ``num_threads`` torch threads (default 1 on CPU) and then
  restores the caller's setting. Decoding a small batch gains little from a second thread, while
  OpenMP spin-waiting on a busy machine is ruinous: on this project's shared 2-core machine the
  tiny preset decoded 628 tok/s with 1 thread and 27 tok/s with 2 (load ~7). vLLM's CPU worker
  makes the same choice for the same reason.
* Sampling randomness comes from one ``torch.Generator`` per request, seeded by the request's
  ``SamplingSettings.seed`` or, when absent, drawn from the engine's own seeded stream; inverse-CDF
  sampling over the top-p-filtered distribution.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from trace_rl.rollout.types import Completion, GenRequest


def validate_requests(requests: Sequence[GenRequest], vocab_size: int) -> None:
    """Raise ``ValueError`` naming the request and field that is out of range."""
    for i, r in enumerate(requests):
        s = r.sampling
        where = f"request {i}"
        if not r.prompt_ids:
            raise ValueError(f"{where}: prompt_ids is empty")
        bad = [t for t in r.prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{where}: prompt_ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if r.n < 1:
            raise ValueError(f"{where}: n={r.n}, need n >= 1")
        if s.max_tokens < 1:
            raise ValueError(f"{where}: sampling.max_tokens={s.max_tokens}, need >= 1")
        if s.temperature < 0:
            raise ValueError(f"{where}: sampling.temperature={s.temperature}, need >= 0")
        if not 0 < s.top_p <= 1:
            raise ValueError(f"{where}: sampling.top_p={s.top_p}, need 0 < top_p <= 1")
        if any(not stop for stop in s.stop):
            raise ValueError(f"{where}: sampling.stop contains an empty string")


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """End index (exclusive) of the earliest stop string occurring at or after ``start``."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0 and (best is None or at + len(stop) < best):
            best = at + len(stop)
    return best


class _Row:
    """Book-keeping for one sampled sequence while it decodes."""

    __slots__ = ("req", "ids", "logprobs", "text_len", "text", "finish")

    def __init__(self, req: int) -> None:
        self.req = req
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text_len = 0  # chars of decoded text already searched for stop strings
        self.text: str | None = None
        self.finish: str | None = None


class HFEngine:
    """Batched sampling with a transformers causal LM; see the module docstring for semantics."""

    name = "hf"

    def __init__(self, model_dir: str | Path, *, device: str | None = None,
                 dtype: str | None = None, seed: int = 0, max_batch_rows: int = 64,
                 num_threads: int | None = None) -> None:
        """
        Args:
            model_dir: a saved HF causal-LM directory (safetensors + tokenizer).
            device: "cpu" or "cuda"; default cuda when available.
            dtype: torch dtype name; default float32 on CPU (exact agreement with vLLM in tests),
                bfloat16 on CUDA.
            seed: seeds the stream that gives unseeded requests their generators.
            max_batch_rows: rows decoded together; more rows are processed in chunks.
            num_threads: torch threads while generating; default 1 on CPU, untouched on CUDA.
        """
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")
        self.dtype = getattr(torch, dtype)
        self.model_dir = str(model_dir)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.max_batch_rows = max_batch_rows
        self.num_threads = num_threads if num_threads is not None else (
            1 if self.device == "cpu" else None)
        self._seed_stream = random.Random(seed)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in eos + [self._tokenizer.eos_token_id] if e is not None}
        self.pad_id = self._tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    # ---------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenRequest]) -> list[list[Completion]]:
        """Return, per request, ``request.n`` completions (see module docstring)."""
        validate_requests(requests, self.vocab_size)
        gens = [torch.Generator().manual_seed(
            r.sampling.seed if r.sampling.seed is not None else self._seed_stream.getrandbits(63))
            for r in requests]
        rows = [_Row(i) for i, r in enumerate(requests) for _ in range(r.n)]
        threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            for lo in range(0, len(rows), self.max_batch_rows):
                self._decode(requests, rows[lo:lo + self.max_batch_rows], gens)
        finally:
            torch.set_num_threads(threads)
        out: list[list[Completion]] = [[] for _ in requests]
        for row in rows:
            text = row.text if row.text is not None else self._tokenizer.decode(
                row.ids, skip_special_tokens=True)
            out[row.req].append(Completion(token_ids=row.ids, logprobs=row.logprobs, text=text,
                                           finish_reason=row.finish or "length"))
        return out

    @torch.inference_mode()
    def _decode(self, requests: Sequence[GenRequest], rows: list[_Row],
                gens: list[torch.Generator]) -> None:
        prompts = [requests[r.req].prompt_ids for r in rows]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [B, L]
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, L]
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                            past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1, :]  # [B, V]
        active = list(rows)
        next_pos = pos[:, -1:] + 1  # [B, 1]
        while active:
            tokens, logps = self._sample(logits.float(), requests, active, gens)  # [B], [B]
            keep = []
            for b, row in enumerate(active):
                self._append(row, int(tokens[b]), float(logps[b]), requests[row.req])
                if row.finish is None:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                mask, next_pos, tokens = mask[idx], next_pos[idx], tokens[idx]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)  # [B, L+t]
            logits = self.model(input_ids=tokens[:, None], attention_mask=mask,
                                position_ids=next_pos, past_key_values=cache,
                                use_cache=True).logits[:, -1, :]  # [B, V]
            next_pos = next_pos + 1

    def _sample(self, logits: torch.Tensor, requests: Sequence[GenRequest], active: list[_Row],
                gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per active row; return the tokens [B] and their raw logprobs [B]."""
        raw = torch.log_softmax(logits, dim=-1)  # [B, V]
        tokens = raw.argmax(dim=-1)  # [B] greedy default; overwritten for sampled rows
        temps = torch.tensor([requests[r.req].sampling.temperature for r in active],
                             device=logits.device)  # [B]
        hot = (temps > 0).nonzero().flatten()
        if len(hot):
            top_p = torch.tensor([requests[active[b].req].sampling.top_p for b in hot.tolist()],
                                 device=logits.device)  # [H]
            probs = torch.softmax(logits[hot] / temps[hot, None], dim=-1)  # [H, V]
            sorted_p, order = probs.sort(dim=-1, descending=True)  # [H, V]
            cum = sorted_p.cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            sorted_p = torch.where(cum - sorted_p < top_p[:, None], sorted_p, 0.0)
            cdf = sorted_p.cumsum(dim=-1)  # [H, V]
            u = torch.empty(len(hot), dtype=cdf.dtype)
            for j, b in enumerate(hot.tolist()):  # each request draws from its own generator
                u[j] = torch.rand((), generator=gens[active[b].req], dtype=cdf.dtype)
            pick = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None]).clamp(
                max=cdf.shape[-1] - 1)  # [H, 1]
            tokens[hot] = order.gather(-1, pick).squeeze(-1)
        return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1)

    def _append(self, row: _Row, token: int, logprob: float, req: GenRequest) -> None:
        row.ids.append(token)
        row.logprobs.append(logprob)
        if token in self.eos_ids:
            row.finish = "stop"
            return
        if req.sampling.stop:
            text = self._tokenizer.decode(row.ids, skip_special_tokens=True)
            end = find_stop(text, req.sampling.stop, row.text_len)
            row.text_len = len(text)
            if end is not None:
                row.text, row.finish = text[:end], "stop"
                return
        if len(row.ids) >= req.sampling.max_tokens:
            row.finish = "length"

    # ---------------------------------------------------------------- weights
    def load_weights(self, model_dir: str | Path) -> float:
        """Copy the weights saved in ``model_dir`` into the live model in place; return seconds."""
        t0 = time.perf_counter()
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"HFEngine.load_weights: no *.safetensors in {model_dir}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        self._load_state(state, str(model_dir))
        return time.perf_counter() - t0

    def load_tensors(self, state: dict[str, torch.Tensor]) -> float:
        """Copy named tensors (a state dict, as a weight broadcast delivers it) into the live
        model in place; return seconds."""
        t0 = time.perf_counter()
        self._load_state(state, "the tensors given")
        return time.perf_counter() - t0

    def _load_state(self, state: dict[str, torch.Tensor], model_dir: str) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        if self.model.config.tie_word_embeddings:
            tied.add("lm_head.weight")
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"HFEngine.load_weights: {model_dir} does not match the live model "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        self.model.tie_weights()

    def close(self) -> None:
        self.model = None
