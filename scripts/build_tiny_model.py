#!/usr/bin/env python
"""Build the embedded default: tokenizer, tiny pretrained Llama and task data (deterministic).

    .venv/bin/python scripts/build_tiny_model.py                  # full build into lora_kit/embedded
    .venv/bin/python scripts/build_tiny_model.py --tiny-test --out /tmp/x   # seconds, for tests

What it does, from one seed:
1. generates synthetic rows of eight base tasks (lora_kit.embedded.tasks.BASE_TASKS) and of the new task
   (dates, never shown to the base), in the kit's one prompt format (lora_kit.prompting);
2. writes the shipped JSONL data: dates_{train,validation,test}.jsonl (distinct dates, no exact or
   normalized duplicates across splits), control.jsonl (held-out base-task rows) and
   base_mix.jsonl (base-task rows users can mix into fine-tuning data to limit forgetting);
3. trains a character-level tokenizer with the ``tokenizers`` library (trainer picks the alphabet
   from the corpus, every printable ASCII character is covered, padded with reserved tokens to a
   vocabulary that is a multiple of 64); BOS is added by the post-processor;
4. pretrains a standard LlamaForCausalLM on the base tasks with the kit's one training step
   (``lora_kit.training.train_step``; loss on responses only; control prompts are excluded from
   pretraining where the task's input space allows), then
5. saves model (safetensors) + tokenizer with ``save_pretrained``, measures base exact match per
   task on the control set and on the dates test split, and writes build_info.json (settings,
   measured accuracies, file sizes and sha256 of every shipped file).

Trade-off: characters are single tokens, so a tiny model can do character tasks (reverse, hyphenate)
without sub-word confusion; only fixed phrases (task prefixes, "\nAnswer: ", month names) are whole
tokens, which keeps sequences short (~15 tokens for base tasks, ~33 for dates).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lora_kit import training  # noqa: E402
from lora_kit.embedded import story, tasks  # noqa: E402
from lora_kit.evaluation.hygiene import normalize  # noqa: E402
from lora_kit.results import write_json_atomic, write_text_atomic  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3
# Whole-phrase tokens: the answer marker, the base tasks' prefixes and the month names. They halve
# sequence length (= pretraining time); random-letter inputs are lowercase and never contain them.
# The new task's prefix ("Date to ISO: ") deliberately stays character-level: a phrase token the
# base never saw would have an untrained embedding.
PHRASES = ("\nAnswer: ",) + tasks.BASE_PREFIXES + tasks.MONTHS
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n"
                 "Answer: {% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}"
                 "{% endfor %}")
# Full-build defaults; --tiny-test overrides them with a seconds-long build.
DEFAULTS = dict(seed=0, hidden=128, layers=4, heads=2, kv_heads=2, ffn=256, max_positions=256,
                steps=1200, batch_size=64, lr=4e-3, warmup=50, dates_train=2000, dates_validation=200,
                dates_test=400, control_per_task=40, base_mix_per_task=250, threads=1)
TINY_TEST = dict(hidden=64, layers=1, heads=1, kv_heads=1, ffn=128, steps=3, batch_size=8, warmup=1,
                 dates_train=20, dates_validation=5, dates_test=5, control_per_task=2, base_mix_per_task=4)
DATA_FILES = ("dates_train.jsonl", "dates_validation.jsonl", "dates_test.jsonl", "control.jsonl",
              "base_mix.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "lora_kit" / "embedded"), help="writes OUT/tiny and OUT/data")
    p.add_argument("--tiny-test", action="store_true", help="seconds-long build at a reduced size (tests)")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v}")
    a = p.parse_args(argv)
    base = {**DEFAULTS, **(TINY_TEST if a.tiny_test else {})}
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k in ("hidden", "ffn"):
        if getattr(a, k) % 64:
            raise ValueError(f"--{k} must be a multiple of 64 (4-bit CPU kernels need it), got {getattr(a, k)}.")
    if a.hidden % a.heads or a.heads % a.kv_heads or (a.hidden // a.heads * a.kv_heads) % 64:
        raise ValueError("--hidden/--heads/--kv-heads must give a whole head size and k/v widths that are "
                         f"multiples of 64; got hidden={a.hidden}, heads={a.heads}, kv_heads={a.kv_heads}.")
    return a


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
def make_data(a) -> dict[str, list[dict]]:
    rng = random.Random(a.seed)
    control, seen = [], set()
    for task in sorted(tasks.BASE_TASKS):
        rows, tries = [], 0
        while len(rows) < a.control_per_task:
            r = tasks.base_example(rng, task)
            tries += 1
            if r["prompt"] in seen and tries < 100 * a.control_per_task:
                continue
            seen.add(r["prompt"])
            rows.append(r)
        control += rows
    held_out = {r["prompt"] for r in control if r["task"] not in tasks.SMALL_INPUT_SPACE}
    base_mix = []
    for task in sorted(tasks.BASE_TASKS):
        n = 0
        while n < a.base_mix_per_task:
            r = tasks.base_example(rng, task)
            if r["prompt"] not in held_out:
                base_mix.append(r)
                n += 1
    rng.shuffle(base_mix)
    dates, keys = [], set()
    need = a.dates_train + a.dates_validation + a.dates_test
    while len(dates) < need:
        r = tasks.date_example(rng)
        k = normalize(r["response"])  # one row per calendar date: no duplicates across splits
        if k not in keys:
            keys.add(k)
            dates.append(r)
    i, j = a.dates_train, a.dates_train + a.dates_validation
    return {"dates_train.jsonl": dates[:i], "dates_validation.jsonl": dates[i:j], "dates_test.jsonl": dates[j:],
            "control.jsonl": control, "base_mix.jsonl": base_mix, "_held_out": held_out}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def train_tokenizer(corpus: list[str], out_dir: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    # One token per known phrase (task prefixes, "\nAnswer: ", month names), else per character.
    words = "|".join(w.replace("\n", "\\n") for w in PHRASES)  # no regex metacharacters in them
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|[\\s\\S]"), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=0, show_progress=False)
    tk.train_from_iterator(corpus + [string.printable], trainer=trainer)
    vocab = tk.get_vocab()
    size = -(-len(vocab) // 64) * 64
    for k in range(size - len(vocab)):
        vocab[f"<reserved_{k}>"] = len(vocab)
    tk.model = models.WordLevel(vocab=vocab, unk_token="<unk>")  # padded to a multiple of 64
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                      special_tokens=[("<s>", vocab["<s>"])])
    tk.no_padding()
    tk.no_truncation()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", model_max_length=256)
    tok.chat_template = CHAT_TEMPLATE
    tok.backend_tokenizer.no_padding()
    tok.save_pretrained(out_dir)
    return tok


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------
def pretrain(a, tok, held_out: set[str]):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.ffn,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=a.max_positions, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                      rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; {a.steps} steps of batch {a.batch_size}", flush=True)
    rng = random.Random(a.seed + 1)

    def batch_rows():
        rows = []
        while len(rows) < a.batch_size:
            r = tasks.base_example(rng)
            if r["prompt"] not in held_out:
                rows.append(r)
        return rows

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))

    def lr_at(step):
        if step < a.warmup:
            return (step + 1) / a.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    losses = []
    for step in range(a.steps):  # the kit's one training step, gradients clipped to norm 1
        out = training.train_step(model, story.collate(tok, batch_rows()), opt, scheduler=sched, max_grad_norm=1.0)
        losses.append(out.loss.item())
        if (step + 1) % 50 == 0 or step + 1 == a.steps:
            print(f"step {step + 1}/{a.steps} loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                  f"wall {time.perf_counter() - t0:.0f} s cpu {time.process_time() - c0:.0f} s", flush=True)
    model.eval()
    every_50 = [sum(losses[i:i + 50]) / len(losses[i:i + 50]) for i in range(0, len(losses), 50)]
    stats = {"parameters": n_params, "wall_s": round(time.perf_counter() - t0, 1),
             "cpu_s": round(time.process_time() - c0, 1),
             "final_loss_mean_last_50": sum(losses[-50:]) / len(losses[-50:]),
             "loss_every_50": [round(x, 4) for x in every_50]}
    return model, stats


def file_table(folder: Path) -> dict:
    return {p.name: {"bytes": p.stat().st_size, "sha256": tasks.sha256_file(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name not in ("build_info.json", "MODEL_CARD.md")}


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(a.out)
    model_dir, data_dir = out / "tiny", out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    data = make_data(a)
    held_out = data.pop("_held_out")
    for name, rows in data.items():
        write_jsonl(data_dir / name, rows)
    corpus = [r["prompt"] + "\nAnswer: " + r["response"] for rows in data.values() for r in rows]
    tok = train_tokenizer(corpus, model_dir)

    model, stats = pretrain(a, tok, held_out)
    model.save_pretrained(model_dir, safe_serialization=True)

    from lora_kit.loading import load_tokenizer
    tok = load_tokenizer(str(model_dir))  # measure with the tokenizer exactly as users load it
    base_control = story.exact_match(model, tok, data["control.jsonl"])
    base_dates = story.exact_match(model, tok, data["dates_test.jsonl"])
    print("base exact match per task:", json.dumps(base_control["per_task"]), flush=True)
    print(f"base control mean {base_control['exact_match']:.3f}; dates test {base_dates['exact_match']:.3f}",
          flush=True)

    settings = {k: getattr(a, k) for k in DEFAULTS} | {"tiny_test": a.tiny_test}
    info = {
        "settings": settings,
        "versions": {"torch": torch.__version__, **_versions()},
        "pretraining": stats,
        "measured": {"control_exact_match": base_control["exact_match"],
                     "control_per_task": base_control["per_task"],
                     "dates_test_exact_match": base_dates["exact_match"],
                     "dates_test_examples": base_dates["n"], "control_examples": base_control["n"],
                     "decoding": "greedy, left-padded batches of 64, max_new_tokens=16"},
        "model_files": file_table(model_dir),
        "data_files": file_table(data_dir),
        "data_rows": {name: len(rows) for name, rows in data.items()},
    }
    write_json_atomic(model_dir / "build_info.json", info)
    total = sum(f["bytes"] for f in info["model_files"].values()) + sum(f["bytes"] for f in info["data_files"].values())
    print(f"wrote {model_dir} and {data_dir}: {total / 1e6:.2f} MB in total", flush=True)
    return info


def _versions() -> dict:
    import tokenizers
    import transformers
    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


if __name__ == "__main__":
    main()
