"""Generation stops where the model's turn ends, and a reasoning template's think block is judged deliberately.

A stand-in model returns fixed continuations (what the issue saw: Gemma-3's adapter answering
``OK<end_of_turn>\\nOK…`` and Qwen3's ``<think>\\n\\n</think>\\n\\nOK``), so the rule is checked without
training; the chat templates are TRL's (see test_chat_tokens)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from test_chat_tokens import _tokenizer, _trl_template  # noqa: E402

from lora_kit.generation import answer_text, generate, stop_ids  # noqa: E402
from lora_kit.prompting import PromptFormat  # noqa: E402


class Replay(torch.nn.Module):
    """Returns the prompt followed by ``tail`` (a fixed continuation); records the generation config."""

    def __init__(self, tail: list[int], eos):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tail, self.generation_config, self.seen = tail, SimpleNamespace(eos_token_id=eos), None

    def generate(self, input_ids, attention_mask, generation_config, stopping_criteria):
        self.seen = generation_config
        tail = torch.tensor([self.tail] * input_ids.shape[0])
        return torch.cat([input_ids, tail], 1)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_gemma3_stops_at_generation_config_end_of_turn():
    tok = _tokenizer("bytelevel", _trl_template("gemma3"), "<bos>", "<eos>")
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    model = Replay(_ids(tok, "OK<end_of_turn>\nOK<end_of_turn>\nOK"), eos=[tok.eos_token_id, eot])
    fmt = PromptFormat(tok, "chat")
    assert eot in stop_ids(model, fmt) and eot in model.generation_config.eos_token_id
    assert generate(model, tok, ["Say OK."], fmt=fmt, max_new_tokens=12) == ["OK"]
    assert eot in model.seen.eos_token_id


def test_generation_config_eos_list_is_honoured_even_when_the_template_is_silent():
    tok = _tokenizer("sentencepiece", _trl_template("phi3"), "<s>", "<|endoftext|>")
    end = tok.convert_tokens_to_ids("<|end|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no end-of-turn of its own
    fmt = PromptFormat(tok, "chat")
    model = Replay(_ids(tok, "OK<|end|>more"), eos=[tok.eos_token_id, end])
    assert generate(model, tok, ["Say OK."], fmt=fmt) == ["OK"]


def test_qwen3_think_block_judged_after_it_by_default():
    tok = _tokenizer("bytelevel", _trl_template("qwen3"), "<|endoftext|>", "<|im_end|>")
    tail = _ids(tok, "<think>\n\n</think>\n\nOK<|im_end|>\n")
    fmt = PromptFormat(tok, "chat")
    assert generate(Replay(tail, eos=tok.eos_token_id), tok, ["Say OK."], fmt=fmt, max_new_tokens=12) == ["OK"]
    whole = generate(Replay(tail, eos=tok.eos_token_id), tok, ["Say OK."], fmt=fmt, think="whole")
    assert whole == ["<think>\n\n</think>\n\nOK"]
    assert answer_text("<think>still thinking", "answer") == ""  # budget ran out inside the block
    with pytest.raises(ValueError, match="think='keep' is not valid"):
        answer_text("x", "keep")
