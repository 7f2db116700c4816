"""Conversations are tokenised once, and the trained tokens are TRL's.

Two tokenizers are built offline with the ``tokenizers`` library: a byte-level BPE (GPT-2 / Llama-3 /
Qwen style) and a SentencePiece-style BPE (Metaspace ``▁``, byte fallback; Llama-2 / Mistral / Phi-3
style). The chat templates of Gemma-3, Qwen3 and Phi-3 are read from the installed TRL
(``trl/chat_templates/``) at test time. TRL ships no template for Mixtral, Granite or OLMo-2: theirs are
written here from the models' documented chat formats (Mixtral-8x7B-Instruct's ``[INST] … [/INST]``,
Granite 3's ``<|start_of_role|>…<|end_of_role|>…<|end_of_text|>``, OLMo-2's ``<|user|>\\n…``), each once
as the model ships it and once with ``{% generation %}`` markers around the assistant's text and its end of
turn, which is what TRL's ``assistant_only_loss`` needs.

The reference is TRL's own dataset preparation (``SFTTrainer._prepare_dataset``, with the training template
TRL swaps in for ``assistant_only_loss=True``): ``train_on="assistant"`` equals ``assistant_only_loss=True``,
``"all"`` equals the default ``assistant_only_loss=False``, and ``"last"`` is the last assistant turn of the
``"all"`` tokenisation. One documented difference: for Qwen3 with several assistant turns TRL's training
template writes an empty think block into every earlier turn, which the model's own template (what
inference sees) leaves out; there the ids are the model template's, compared with ``"all"``.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from lora_kit.prompting import IGNORE_INDEX, PromptFormat  # noqa: E402

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>",
            "<|im_end|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "[INST]", "[/INST]",
            "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"]
ADDED = ["<think>", "</think>"]  # added, not special (as in Qwen3's tokenizer)
CORPUS = ["Hello there, how are you today?", "What is two plus two? Four.", "Say OK. OK", "Answer: OK",
          "The capital of France is Paris.", "Be brief and answer in one word.", "Name a colour: blue, red",
          "Thanks! You are welcome.", "user model assistant system", "think about it, then answer"] * 20


def _tokenizer(kind: str, template: str, bos: str, eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    if kind == "bytelevel":
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS
                                      + [f"<0x{i:02X}>" for i in range(256)])
    tk.train_from_iterator(CORPUS, trainer)
    tk.add_tokens(ADDED)
    bos_id = tk.token_to_id(bos)
    tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = template
    return tok


def _trl_template(name: str) -> str:
    import trl
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


# written from the documented formats (see the module docstring); G( … )G marks the assistant's trained text
MIXTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}G({{ message['content'] + eos_token }})G"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
GRANITE = ("{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
           "{{- '<|start_of_role|>assistant<|end_of_role|>' }}G({{- message['content'] + '<|end_of_text|>\n' }})G"
           "{%- else %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + "
           "'<|end_of_text|>\n' }}{%- endif %}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}")
OLMO2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + "
         "message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + "
         "'\n' }}{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' }}G({{ message['content'] + "
         "eos_token }})G{% if not loop.last %}{{ '\n' }}{% endif %}{% endif %}"
         "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}")


def _shipped(t: str) -> str:
    return t.replace("G(", "").replace(")G", "")


def _marked(t: str) -> str:
    return t.replace("G(", "{% generation %}").replace(")G", "{% endgeneration %}")


FAMILIES = {  # name -> (shipped template, TRL's template for assistant_only_loss or None: TRL swaps its own, bos, eos)
    "gemma3": (lambda: _trl_template("gemma3"), None, "<bos>", "<eos>"),
    "qwen3": (lambda: _trl_template("qwen3"), None, "<|endoftext|>", "<|im_end|>"),
    "phi3": (lambda: _trl_template("phi3"), None, "<s>", "<|endoftext|>"),
    "mixtral": (lambda: _shipped(MIXTRAL), lambda: _marked(MIXTRAL), "<s>", "</s>"),
    "granite": (lambda: _shipped(GRANITE), lambda: _marked(GRANITE), "<|end_of_text|>", "<|end_of_text|>"),
    "olmo2": (lambda: _shipped(OLMO2), lambda: _marked(OLMO2), "<|endoftext|>", "<|endoftext|>"),
}
NO_SYSTEM = {"mixtral"}


def _conversations(system: bool) -> list[list[dict]]:
    sys = [{"role": "system", "content": "Be brief and answer in one word."}] if system else []
    u, a = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant", "content": t})
    return [sys + [u("Say OK."), a("OK")],
            sys + [u("What is two plus two?"), a("Four."), u("Name a colour:"), a("blue")],
            sys + [u("Hello there, how are you today?"), a("Thanks! OK"), u("The capital of France?"), a("Paris."),
                   u("Say OK."), a("OK")]]


def _trl(tok, rows: list[dict], assistant_only: bool, marked: str | None) -> list[tuple[list, list]]:
    """TRL's own preparation of ``rows`` (input_ids, labels)."""
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import get_training_chat_template
    args = SFTConfig(output_dir="/tmp/unused", assistant_only_loss=assistant_only, dataset_num_proc=None,
                     max_length=None, report_to=[], bf16=False, use_cpu=True)
    tpl = None
    if assistant_only:
        tpl = marked or get_training_chat_template(tok)
    me = SimpleNamespace(_tokenizer=tok, chat_template=tpl, completion_only_loss="prompt" in rows[0],
                         args=args)
    ds = SFTTrainer._prepare_dataset(me, datasets.Dataset.from_list(rows), tok, args, False, None, "train")
    out = []
    for r in ds:
        ids = list(r["input_ids"])
        if "labels" in r:
            labels = list(r["labels"])
        else:  # TRL builds labels in the collator from these masks
            mask = [1] * len(ids)
            for k in ("assistant_masks", "completion_mask"):
                if k in r and (k != "completion_mask" or me.completion_only_loss):
                    mask = [m and n for m, n in zip(mask, r[k])]
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        out.append((ids, labels))
    return out


def _mine(tok, conv: list[dict], train_on: str):
    ex = {"prompt": conv[-2]["content"], "response": conv[-1]["content"], "context": conv[:-1]}
    e = PromptFormat(tok, "chat", train_on=train_on).encode(ex)
    return e["input_ids"], e["labels"]


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_and_masks_equal_trl(family, kind):
    shipped, marked, bos, eos = FAMILIES[family]
    tok = _tokenizer(kind, shipped(), bos, eos)
    convs = _conversations(system=family not in NO_SYSTEM)
    rows = [{"messages": c} for c in convs]
    trl_all = _trl(tok, rows, False, None)
    trl_asst = _trl(tok, rows, True, marked() if marked else None)
    for conv, (a_ids, a_lab), (s_ids, s_lab) in zip(convs, trl_all, trl_asst):
        ids, labels = _mine(tok, conv, "all")
        assert (ids, labels) == (a_ids, a_lab)  # TRL's default: the whole conversation
        ids, labels = _mine(tok, conv, "assistant")
        n_turns = sum(m["role"] == "assistant" for m in conv)
        if family == "qwen3" and n_turns > 1:  # TRL's training template adds think blocks to earlier turns
            assert ids == a_ids and s_ids != a_ids
        else:
            assert ids == s_ids, tok.convert_ids_to_tokens(ids)
            assert labels == s_lab, (tok.convert_ids_to_tokens([t for t in labels if t >= 0]),
                                     tok.convert_ids_to_tokens([t for t in s_lab if t >= 0]))
        # last: the last assistant turn of the same tokenisation, a subset of "assistant"
        ids_l, last = _mine(tok, conv, "last")
        assert ids_l == ids
        trained = [i for i, t in enumerate(last) if t != IGNORE_INDEX]
        assert trained and all(labels[i] == last[i] for i in trained)
        assert trained == list(range(trained[0], trained[-1] + 1))  # one contiguous turn
        turn = tok.decode([ids[i] for i in trained], skip_special_tokens=True)
        assert turn.strip().endswith(conv[-1]["content"])
        if n_turns > 1:
            assert sum(t != IGNORE_INDEX for t in labels) > len(trained)


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_prompt_completion_equals_trl_and_generation_sees_the_training_context(kind):
    """The plain format is TRL's prompt/completion path (completion + EOS, tokenised with the prompt once)."""
    tok = _tokenizer(kind, _trl_template("phi3"), "<s>", "<|endoftext|>")
    rows = [{"prompt": "Say OK.\nAnswer: ", "completion": "OK"},
            {"prompt": "What is two plus two?\nAnswer: ", "completion": "Four."}]
    ref = _trl(tok, rows, False, None)
    fmt = PromptFormat(tok, "plain")
    for r, (t_ids, t_lab) in zip(rows, ref):
        e = fmt.encode({"prompt": r["prompt"][:-len("\nAnswer: ")], "response": r["completion"]})
        assert (e["input_ids"], e["labels"]) == (t_ids, t_lab)
        first = next(i for i, t in enumerate(e["labels"]) if t != IGNORE_INDEX)
        assert fmt.prompt_ids(r["prompt"][:-len("\nAnswer: ")]) == e["input_ids"][:first]


def test_system_message_merged_when_the_template_has_no_system_role():
    tok = _tokenizer("sentencepiece", _shipped(MIXTRAL), "<s>", "</s>")
    fmt = PromptFormat(tok, "chat")
    assert fmt.merge_system and "no system role" in fmt.notes[0]
    conv = _conversations(system=True)[0]
    ids, labels = _mine(tok, conv, "assistant")
    text = tok.decode(ids)
    assert "[INST] Be brief and answer in one word.\n\nSay OK. [/INST]" in text.replace("  ", " ")
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "OK</s>"
    # a template that accepts it is left alone
    assert not PromptFormat(_tokenizer("bytelevel", _trl_template("qwen3"), "<|endoftext|>", "<|im_end|>"),
                            "chat").merge_system


def test_end_of_turn_is_a_stop_token():
    tok = _tokenizer("bytelevel", _trl_template("gemma3"), "<bos>", "<eos>")
    fmt = PromptFormat(tok, "chat")
    assert fmt.end_of_turn == "<end_of_turn>\n"
    assert tok.convert_tokens_to_ids("<end_of_turn>") in fmt.stop_ids


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_text_rows_equal_trl_language_modelling(kind):
    tok = _tokenizer(kind, _trl_template("phi3"), "<s>", "<|endoftext|>")
    rows = [{"text": "Hello there, how are you today?"}, {"text": "Answer: OK"}]
    for r, ref in zip(rows, _trl(tok, rows, False, None)):
        for chat in ("plain", "chat"):
            e = PromptFormat(tok, chat).encode({"prompt": "", "response": "", "text": r["text"]})
            assert (e["input_ids"], e["labels"]) == ref
