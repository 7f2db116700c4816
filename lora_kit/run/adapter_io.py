"""Save an adapter, load it into a fresh base, and prove it is the adapter that was trained.

Checks (the ones peft's own save/reload tests make, plus the ones users get bitten by):
files present and non-empty, only adapter files written (``adapter_model.safetensors`` +
``adapter_config.json``; peft's auto-generated README.md model card is removed), every saved
tensor is a LoRA tensor, no missing or unexpected adapter keys on reload, reloaded logits equal
the trained model's, and the adapter changes the outputs versus the base.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import torch

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def save_adapter(model, out_dir, is_main_process: bool = True, state_dict: dict | None = None,
                 base_model_name: str | None = None) -> dict:
    """Save the adapter with safetensors, atomically; returns {file: bytes} of what is on disk.

    ``state_dict``: the tensors to save instead of the model's own (peft keeps its LoRA entries), e.g. the
    adapter gathered whole from FSDP2 shards (:func:`lora_kit.run.distributed.full_trainable_state`); the
    files are the same peft format either way.

    The files are written into a temporary folder beside ``out_dir`` and renamed into place only when
    complete, so ``out_dir`` never holds half an adapter (a kill during the save leaves the previous
    adapter, or none). Files are 0644 like every result; ``adapter_config.json`` is rewritten with
    sorted keys and sorted ``target_modules`` and ``target_parameters`` (peft writes sets, whose order changes per
    process; it wraps the targeted parameters in sorted order whatever the file's order),
    so identical adapters are identical bytes. ``base_model_name`` replaces peft's
    ``base_model_name_or_path`` (the path the base was loaded from, often a local absolute path) with the model's
    name (:func:`portable_model_name`): the adapter is meant to be shared, and names no local folder.
    A file that cannot be written (full disk) raises :class:`lora_kit.results.NotWritten` naming the folder;
    the previous adapter stays.
    """
    import shutil
    import tempfile
    out = Path(out_dir)
    if not is_main_process:
        return {}
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.saving-*"):  # left by a save that was killed outright
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.saving-", dir=out.parent))
    old = out.parent / f".{out.name}.replaced-{tmp.name.rsplit('-', 1)[-1]}"
    try:
        model.save_pretrained(str(tmp), safe_serialization=True, state_dict=state_dict)
        card = tmp / "README.md"
        if card.exists():
            card.unlink()
        _deterministic_config(tmp / "adapter_config.json", base_model_name)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except Exception as exc:
        from lora_kit.results import NotWritten, disk_full
        if isinstance(exc, NotWritten) or not disk_full(exc):
            raise
        raise NotWritten(out, exc if isinstance(exc, OSError) else OSError(errno.ENOSPC, str(exc))) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return {p.name: p.stat().st_size for p in sorted(out.iterdir())}


def _deterministic_config(path: Path, base_model_name: str | None = None) -> None:
    cfg = json.loads(path.read_text())
    for k in ("target_modules", "target_parameters", "modules_to_save", "exclude_modules"):
        if isinstance(cfg.get(k), list):
            cfg[k] = sorted(cfg[k])
    if base_model_name is not None:
        cfg["base_model_name_or_path"] = base_model_name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")  # inside the save's temp folder


def portable_model_name(model: str) -> str:
    """The name an adapter records for its base: a hub id or "tiny" as given, a local folder by its own name
    (the last path component, which :func:`lora_kit.evaluation.adapters.check_adapter` matches), never a local
    absolute path."""
    model = os.fspath(model)
    if os.path.isabs(os.path.expanduser(model)) or os.path.exists(os.path.expanduser(model)):
        return Path(model.rstrip("/")).name
    return model


def check_adapter_files(adapter_dir) -> dict:
    """Files present, non-empty, only adapter files, only LoRA tensors. Raises ValueError if not."""
    from safetensors import safe_open
    d = Path(adapter_dir)
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir())} if d.is_dir() else {}
    missing = [f for f in ADAPTER_FILES if f not in files]
    if missing:
        raise ValueError(f"adapter folder {str(d)!r} lacks {missing}: save it with save_pretrained(safe_serialization=True).")
    empty = [f for f, n in files.items() if n == 0]
    if empty:
        raise ValueError(f"adapter files {empty} in {str(d)!r} are empty: the save was interrupted; save again.")
    extra = sorted(set(files) - set(ADAPTER_FILES))
    if extra:
        raise ValueError(f"adapter folder {str(d)!r} holds non-adapter files {extra}: only {list(ADAPTER_FILES)} "
                         "should be written (was the full model saved?).")
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    non_lora = [k for k in keys if "lora_" not in k]
    if not keys or non_lora:
        raise ValueError(f"adapter weights hold {len(keys)} tensors, {len(non_lora)} of them not LoRA "
                         f"(e.g. {non_lora[:3]}); save only the adapter.")
    return {"files": files, "n_tensors": len(keys), "bytes": sum(files.values())}


def load_adapter(base_model, adapter_dir):
    """``PeftModel`` of ``base_model`` + the adapter; ValueError if it was saved for another base.

    Returns (model, {"missing_keys": [...], "unexpected_keys": [...]}) -- both lists must be empty.
    """
    from peft import PeftModel, set_peft_model_state_dict
    from peft.utils import load_peft_weights
    d = Path(adapter_dir)
    cfg = json.loads((d / "adapter_config.json").read_text())
    saved_for = cfg.get("base_model_name_or_path")
    hint = (f"the adapter at {str(d)!r} was saved for base {saved_for!r}; load it into that base model "
            "(same architecture and sizes) or train a new adapter for this one.")
    try:
        model = PeftModel.from_pretrained(base_model, str(d), is_trainable=False)
        keys = set_peft_model_state_dict(model, load_peft_weights(str(d)))
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"{hint} ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
    missing = [k for k in keys.missing_keys if "lora_" in k]
    unexpected = list(keys.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"{hint} Missing adapter keys: {missing[:5]}, unexpected keys: {unexpected[:5]}.")
    return model, {"missing_keys": missing, "unexpected_keys": unexpected}


@torch.no_grad()
def logits(model, batch: dict, adapter: bool = True) -> torch.Tensor:
    """Logits of ``model`` on ``batch`` in eval mode; ``adapter=False`` uses the base (adapter disabled)."""
    was_training = model.training
    model.eval()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    try:
        if adapter:
            out = model(**inputs).logits
        else:
            with model.disable_adapter():
                out = model(**inputs).logits
    finally:
        model.train(was_training)
    return out.float() * batch["attention_mask"].unsqueeze(-1)


def compare_logits(trained: torch.Tensor, reloaded: torch.Tensor, base: torch.Tensor, tol: float) -> dict:
    """Verdicts: reloaded == trained within ``tol``; adapter changes outputs vs base."""
    reload_diff = (trained - reloaded).abs().max().item()
    change = (trained - base).abs().max().item()
    return {"reload_max_abs_diff": reload_diff, "tolerance": tol, "reload_equal": reload_diff <= tol,
            "adapter_vs_base_max_abs_diff": change, "adapter_changes_outputs": change > tol}


@torch.no_grad()
def generate_side_by_side(model, tokenizer, prompts: list, max_new_tokens: int, fmt=None) -> list[dict]:
    """Base (adapter disabled) and adapter answers per prompt, with evaluate's generation
    (greedy, left padding, stop at EOS or newline; prompt format ``fmt``) so the smoke run and 04 read alike."""
    from lora_kit.generation import generate
    model.eval()
    with model.disable_adapter():
        base = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, fmt=fmt)
    tuned = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, fmt=fmt)
    return [{"prompt": p if isinstance(p, str) else p["prompt"], "base": b, "adapter": a}
            for p, b, a in zip(prompts, base, tuned)]
