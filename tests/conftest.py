"""Shared fixtures: small real models built locally (no hub), offline environment, and the
expensive things trained or run once per session (the tiny-model story, a toy adapter on the
random Llama, the main job). Use these rather than training or running notebooks again."""
from __future__ import annotations

import contextlib
import os
import random
import string

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_script(relpath: str, name: str):
    """A script of the repository (``benchmarks/grid.py``, ``docs/generate.py`` ...) imported as a module."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / relpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pytest_configure(config):
    """Notebooks executed as a user runs them (nbval's 02, in notebooks/: this conftest's fixtures do not
    reach it, its hooks do) write their relative ``run_dir`` under a temp folder, not into the checkout's
    runs/ (``lora_kit.ui.notebook.runs_base``); removed at the end."""
    import tempfile
    config._lora_kit_runs_base = tempfile.mkdtemp(prefix="lora-kit-interactive-")
    os.environ["LORA_KIT_RUNS_BASE"] = config._lora_kit_runs_base
    # fits made on demand (lora_kit.memory.fits) go to a folder of this run, not the user's cache: what a test
    # estimates never depends on what this machine fitted before; only the shipped fits are shared
    os.environ["LORA_KIT_FITS"] = os.path.join(config._lora_kit_runs_base, "fits")


def pytest_unconfigure(config):
    import shutil
    shutil.rmtree(getattr(config, "_lora_kit_runs_base", ""), ignore_errors=True)


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


# ----------------------------------------------------------------------------------------------
# Trained or run once per session and shared by every test that needs them: a test that trains
# the tiny story, a toy adapter or runs the notebooks again should use these instead.
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def torch_threads(n: int = 1):
    """Tiny models gain nothing from threads; on a shared 2-core CPU a second OpenMP thread only spins."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """One torch thread for the test (use with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    with torch_threads(1):
        yield


# The tiny-model story at test scale: fewer steps and examples than benchmarks/tiny_story.py (whose
# numbers are in MODEL_CARD.md), the same code path (lora_kit.embedded.story.story_run).
STORY_STEPS = 150  # benchmark: 300
STORY_MIX_STEPS = 250  # with 25 % base rows the new task needs more steps (150 steps gave 0.50 here)


@pytest.fixture(scope="session")
def tiny_story(tmp_path_factory):
    """``tiny_story(method="lora", base_share=0.0)`` -> story_run's result for the embedded model
    (before/after exact match on 100 held-out dates and 160 control rows, losses, train seconds) plus
    "adapter_dir": the trained adapter, saved. Each (method, base_share) is trained on first request
    and then shared by every test in the session (CPU: lora ~30 s, qlora ~30 s, lora + 25 % mix ~45 s).
    Read the adapter; never write into it (copy it to tmp_path first)."""
    from lora_kit.embedded.story import story_run
    root = tmp_path_factory.mktemp("tiny_story")
    runs: dict = {}

    def get(method: str = "lora", base_share: float = 0.0) -> dict:
        key = (method, float(base_share))
        if key not in runs:
            with torch_threads(1):
                runs[key] = story_run(method, steps=STORY_MIX_STEPS if base_share else STORY_STEPS,
                                      test_examples=100, control_examples=160, seed=0, base_share=base_share,
                                      adapter_dir=root / f"{method}_mix{round(100 * base_share)}")
        return runs[key]

    return get


def toy_words(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct random lowercase words (3-6 letters)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        if w not in out:
            out.append(w)
    return out


def train_toy_lora(base_dir: str, examples: list[dict], steps: int, out_dir, seed: int = 0) -> str:
    """A rank-8 all-linear LoRA on ``base_dir`` trained for ``steps`` steps (batch 16), saved to ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lora_kit.embedded.story import train_adapter
    from lora_kit.loading import load_model, load_tokenizer
    from lora_kit.run.adapter_io import save_adapter
    tok, model = load_tokenizer(base_dir), load_model(base_dir)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    train_adapter(model, tok, examples, steps=steps, batch_size=16, lr=1e-2, seed=seed, warmup=5)
    save_adapter(model, out_dir)
    return str(out_dir)


@pytest.fixture(scope="session")
def toy_adapters(random_llama_dir, tmp_path_factory):
    """A toy task on the random Llama, trained once per session (~6 s): "Is <word> ok?" -> "yes".

    Returns "train" (220 rows), "heldout" (24 rows, other words), "control" (other prompts whose
    references are the *base* model's own greedy answers, tasks "say"/"echo": the base scores 100 %
    there, so any change an adapter makes is a regression), and two adapters: "good" (60 steps,
    answers "yes" on held-out words) and "weak" (2 steps). Read them; never write into them."""
    from lora_kit.generation import generate
    from lora_kit.loading import load_model, load_tokenizer
    d = str(random_llama_dir)
    root = tmp_path_factory.mktemp("toy_adapters")
    words = toy_words(260)
    rows = [{"prompt": f"Is {w} ok?", "response": "yes"} for w in words]
    train, heldout = rows[:220], rows[220:244]
    control_prompts = [f"Say {w}" for w in words[244:260]]
    with torch_threads(1):
        base_answers = generate(load_model(d), load_tokenizer(d), control_prompts, max_new_tokens=8)
        control = [{"prompt": p, "response": a, "task": "say" if i % 2 else "echo"}
                   for i, (p, a) in enumerate(zip(control_prompts, base_answers)) if a]
        good = train_toy_lora(d, train, 60, root / "good")
        weak = train_toy_lora(d, train, 2, root / "weak")
    return {"train": train, "heldout": heldout, "control": control, "good": good, "weak": weak}


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """The README's main job, run once per session: ``lora-kit run`` executes all five notebooks
    headless (papermill) on the embedded default, ~150 s idle. Returns ``{"rc", "run"}`` (exit code,
    run folder). Tests that need a real complete run read its files; never write into it."""
    from lora_kit.ui.cli import main
    runs = tmp_path_factory.mktemp("main_job")
    return {"rc": main(["run", "--runs-dir", str(runs), "--name", "ci"]), "run": runs / "ci"}

