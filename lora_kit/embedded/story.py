"""The tiny model's story harness: a small train/evaluate loop on the embedded tasks.

:func:`train_adapter` is a deliberately plain loop around the one training step
(:func:`lora_kit.training.train_step`), no Trainer, no callbacks: it is what the tests and
``benchmarks/tiny_story.py`` use to measure the story. The instrumented run users call is
``lora_kit.smoke_run``. :func:`exact_match` decodes greedily with left padding (right padding
silently ruins batched generation of decoder-only models).
"""
from __future__ import annotations

import random
import time

from lora_kit import training
from lora_kit.embedded.tasks import (BASE_TASKS, DATA_DIR, MONTHS, TINY_DIR, base_example,  # noqa: F401
                                     date_example, sha256_file)
from lora_kit.prompting import encode_example
from lora_kit.run.adapter_io import portable_model_name, save_adapter

# ----------------------------------------------------------------------------------------------
# batching, training, evaluation
# ----------------------------------------------------------------------------------------------
def collate(tokenizer, rows: list[dict], max_len: int = 64) -> dict:
    """Right-padded training batch, padded to its longest example (prompt and padding masked in labels)."""
    from lora_kit.run.batches import collate as pad_batch
    enc = [encode_example(tokenizer, r["prompt"], r["response"], max_len=max_len) for r in rows]
    return pad_batch(enc, max(e["length"] for e in enc), tokenizer.pad_token_id)


def train_adapter(model, tokenizer, examples: list[dict], steps: int, batch_size: int = 32,
                  lr: float = 2e-3, seed: int = 0, warmup: int = 20, log_every: int = 0) -> dict:
    """Train the trainable parameters of ``model`` (e.g. a peft LoRA) with AdamW: a plain loop of the
    kit's one training step (:func:`lora_kit.training.train_step`, gradients clipped to norm 1).

    Batches are drawn by a seeded shuffle that cycles through ``examples``; the learning rate
    warms up linearly for ``warmup`` steps, then decays linearly to 10 %. Returns
    ``{"losses", "wall_s", "cpu_s", "steps"}``. Same seed and inputs -> same losses.
    """
    import torch
    if steps <= 0 or batch_size <= 0:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}.")
    if not examples:
        raise ValueError("train_adapter needs at least one example; check the dataset you passed.")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters; wrap it with peft.get_peft_model first.")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    order: list[int] = []
    losses = []
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        batch = collate(tokenizer, [examples[i] for i in order[:batch_size]])
        del order[:batch_size]
        out = training.train_step(model, batch, opt, scheduler=sched, max_grad_norm=1.0)
        losses.append(out.loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps} loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    return {"losses": losses, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "steps": steps}


def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 16,
                     batch_size: int = 64) -> list[str]:
    """Greedy answers in the kit's prompt format: the same generation as ``lora_kit.evaluation.evaluate``."""
    from lora_kit.generation import generate
    model.eval()
    return generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)


def exact_match(model, tokenizer, examples: list[dict], max_new_tokens: int = 16,
                batch_size: int = 64) -> dict:
    """Exact match (after stripping whitespace) overall and per task, plus the predictions."""
    preds = generate_answers(model, tokenizer, [e["prompt"] for e in examples], max_new_tokens, batch_size)
    hits: dict[str, list[int]] = {}
    for e, p in zip(examples, preds):
        hits.setdefault(e.get("task", "all"), []).append(int(p == e["response"].strip()))
    per_task = {t: sum(h) / len(h) for t, h in sorted(hits.items())}
    total = sum(sum(h) for h in hits.values()) / max(1, len(examples))
    return {"exact_match": total, "per_task": per_task, "n": len(examples), "predictions": preds}


def round_robin_by_task(rows: list[dict]) -> list[dict]:
    """Rows reordered so that tasks take turns (control.jsonl is grouped by task; a prefix of the
    reordered list covers every task evenly)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["task"], []).append(r)
    out = []
    for i in range(max(map(len, groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def story_run(method: str = "lora", steps: int = 300, batch_size: int = 32, lr: float = 3e-3,
              base_share: float = 0.0, seed: int = 0, test_examples: int = 200, control_examples: int = 320,
              lora_rank: int = 16, model: str = "tiny", adapter_dir: str | None = None) -> dict:
    """The embedded default's story, measured: base vs LoRA/QLoRA adapter on the dates task.

    Loads the base (``method`` "lora": fp32; "qlora": NF4 via bitsandbytes, CPU repack fix applied),
    measures greedy exact match on the first ``test_examples`` held-out dates and
    ``control_examples`` control rows (every task in turn), trains a rank-``lora_rank``
    all-linear adapter for ``steps`` steps on dates_train (plus ``base_share`` of base_mix rows,
    see ``lora_kit.data.mix_examples``), and measures both again. Returns accuracies before/after,
    per-task control accuracy, losses and wall/CPU seconds of training. Seeds are set before the adapter is created.
    With ``adapter_dir``, the trained adapter is saved there (the kit's atomic save) and its path returned as "adapter_dir";
    its ``base_model_name_or_path`` is ``model``'s portable name ("tiny", a hub id, a local folder's own name).
    """
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from lora_kit.data import load_examples, mix_examples
    from lora_kit.loading import fix_bnb_cpu_repack, load_model, load_tokenizer

    if method not in ("lora", "qlora"):
        raise ValueError(f"method={method!r}: story_run trains adapters; choose 'lora' or 'qlora'.")
    tok = load_tokenizer(model)
    base = load_model(model, method=method)
    test = load_examples("tiny:dates", split="test", limit=test_examples)
    control = round_robin_by_task(load_examples("tiny:control"))[:control_examples]
    train = mix_examples(load_examples("tiny:dates", split="train"), load_examples("tiny:base_mix"),
                         base_share, seed)
    before = {"dates": exact_match(base, tok, test), "control": exact_match(base, tok, control)}
    if method == "qlora":
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear",
                     task_type="CAUSAL_LM")
    model_ = get_peft_model(base, cfg)
    fix_bnb_cpu_repack(model_)
    trained = train_adapter(model_, tok, train, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    after = {"dates": exact_match(model_, tok, test), "control": exact_match(model_, tok, control)}
    if adapter_dir is not None:
        save_adapter(model_, adapter_dir, base_model_name=portable_model_name(model))  # a name, not a local path

    def summary(r):
        return {"exact_match": r["exact_match"], "per_task": r["per_task"], "n": r["n"]}

    return {"method": method, "steps": steps, "batch_size": batch_size, "lr": lr, "base_share": base_share,
            "seed": seed, "lora_rank": lora_rank, "train_examples": len(train),
            "dates_before": before["dates"]["exact_match"], "dates_after": after["dates"]["exact_match"],
            "control_before": summary(before["control"]), "control_after": summary(after["control"]),
            "dates_predictions_after": after["dates"]["predictions"][:5],
            "losses": trained["losses"], "train_wall_s": trained["wall_s"], "train_cpu_s": trained["cpu_s"],
            "adapter_dir": None if adapter_dir is None else str(adapter_dir)}
