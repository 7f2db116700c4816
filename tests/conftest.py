"""Shared fixtures: small real models built locally (no hub), offline environment."""
from __future__ import annotations

import os
import string

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_char_tokenizer(out_dir):
    """A character-level tokenizer (tokenizers library) with <s>, </s>, <pad>; BOS added automatically."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(out_dir)
    return tok


def build_random_llama(out_dir, vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=0):
    """A random-init LlamaForCausalLM saved with safetensors; every linear width a multiple of 64."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
    return cfg


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory):
    """Folder with a tiny random Llama (safetensors) and a char-level tokenizer; fast to build."""
    d = tmp_path_factory.mktemp("random_llama")
    build_char_tokenizer(d)
    build_random_llama(d)
    return d
