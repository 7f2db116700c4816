"""Does this adapter belong to this base? Checked before peft loads anything.

A LoRA adapter trained on another base either fails deep inside peft with a shape error or, worse,
loads onto a base of the same shapes and produces confident nonsense. :func:`check_adapter` reads
only ``adapter_config.json`` and the safetensors *header* (shapes, no weights), compares every LoRA
matrix with the base module it targets, and compares the recorded base name. Trade-off: the name
check also refuses the same model saved under another path or hub id; ``check_base_name=False``
skips it when the user knows better (shapes are still checked).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lora_kit.loading import resolve_model


def _same_base(recorded: str | None, base: str, resolved: str) -> bool:
    if not recorded:
        return True
    if recorded in (base, resolved):
        return True
    try:
        r = resolve_model(recorded)
        if os.path.exists(r) and os.path.exists(resolved) and os.path.realpath(r) == os.path.realpath(resolved):
            return True
    except ValueError:
        pass
    # a hub id vs a local copy of it ("org/name" vs ".../name"): same last path component
    return Path(recorded.rstrip("/")).name == Path(resolved.rstrip("/")).name


def local_adapter(path: str) -> str:
    """``path`` if it is a local folder; else a hub id, downloaded (adapter files only, safetensors)."""
    if Path(path).exists() or Path(path).is_absolute() or path.startswith("."):
        return path
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.safetensors"])
    except Exception as e:  # offline, unknown repo, gated: all mean "cannot get it from here"
        raise ValueError(f"adapter {path!r} is not a local folder and could not be fetched from the hub "
                         f"({type(e).__name__}); pass the folder the adapter was saved to.") from None


def _features(mod, name: str, targeted: list[str]) -> tuple[set, set]:
    """The (inputs, outputs) a LoRA on ``mod`` may have: its own in/out features, or -- when the adapter targets
    parameters of it (``target_parameters``, peft's expert LoRA on fused MoE weights) -- those of each targeted
    parameter, by peft's ``ParamWrapper`` rule: a 2-D ``(out, in)``; a 3-D ``(experts, out, in)``, or
    ``(experts, in, out)`` on modules marked ``is_transposed``. Empty sets: nothing to compare."""
    ins, outs = set(), set()
    for pname, prm in mod.named_parameters(recurse=False):
        if not any(f"{name}.{pname}" == t or f"{name}.{pname}".endswith(f".{t}") for t in targeted):
            continue
        shape = tuple(prm.shape)
        if len(shape) == 3 and getattr(mod, "is_transposed", False):
            shape = (shape[0], shape[2], shape[1])
        ins.add(shape[-1])
        outs.add(shape[-2])
    if not ins:
        ins.update({mod.in_features} if hasattr(mod, "in_features") else ())
        outs.update({mod.out_features} if hasattr(mod, "out_features") else ())
    return ins, outs


def check_adapter(path: str, model, base_model: str, resolved: str, check_base_name: bool = True) -> dict:
    """Refuse an adapter that does not belong to this base; returns its adapter_config.

    Checks: the folder has ``adapter_config.json`` and safetensors weights (``.bin`` is refused, never
    unpickled); every LoRA matrix names a module the base has, with matching in/out features; and the
    recorded ``base_model_name_or_path`` names this base (``check_base_name=False`` skips only that).
    """
    p = Path(local_adapter(path))
    cfg_file = p / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{str(p)!r} is not an adapter folder (no adapter_config.json); pass the folder "
                         "written by save_pretrained, e.g. <run_dir>/smoke/adapter.")
    weights = p / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"adapter {str(p)!r} has no adapter_model.safetensors; the kit loads safetensors only "
                         "(re-save it with safe_serialization=True).")
    cfg = json.loads(cfg_file.read_text())
    recorded = cfg.get("base_model_name_or_path")
    from safetensors import safe_open
    with safe_open(str(weights), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    modules = dict(model.named_modules())
    targeted = cfg.get("target_parameters") or []
    for key, shape in shapes.items():
        for part, dim in ((".lora_A.", 1), (".lora_B.", 0)):
            if part not in key:
                continue
            name = key.split(part)[0].removeprefix("base_model.model.")
            if targeted:  # expert LoRA: peft nests one wrapper per parameter, named <module>.base_layer...
                name = re.sub(r"\.base_layer(?=\.|$)", "", name)
            mod = modules.get(name)
            want = None if mod is None else _features(mod, name, targeted)[1 - dim]
            if mod is None or (want and shape[dim] not in want):
                what = "has no module" if mod is None else \
                    f"has {'/'.join(map(str, sorted(want)))} {'inputs' if dim == 1 else 'outputs'} in"
                raise ValueError(
                    f"adapter {str(p)!r} does not fit base {base_model!r}: the base {what} {name!r} "
                    f"(adapter tensor {key} has shape {list(shape)}); it was trained on {recorded!r}. "
                    "Pass base_model= the model the adapter was trained on.")
    if check_base_name and not _same_base(recorded, base_model, resolved):
        raise ValueError(f"adapter {str(p)!r} was trained on {recorded!r}, not on {base_model!r}; pass "
                         f"base_model={recorded!r}, or check_base_name=False if it is the same model saved elsewhere.")
    return cfg


def load_adapters(model, adapters: dict[str, str], base_model: str, resolved: str, check_base_name: bool = True):
    """``model`` with every adapter of ``{name: folder}`` loaded (inference mode, switched by name), as 04 evaluates
    them. Each is checked by :func:`check_adapter` before peft loads it, and after: every tensor of the file has a
    place in the model and every LoRA weight of the adapter came from the file (peft itself only warns), so an
    adapter evaluated is the adapter saved. Expert LoRA (``target_parameters``) reloads onto the nested
    ``ParamWrapper`` layout it was trained with (peft wraps the targeted parameters in sorted order).
    Returns (model, {name: adapter_config}); ``model`` itself when ``adapters`` is empty."""
    cfgs = {name: check_adapter(path, model, base_model, resolved, check_base_name) for name, path in adapters.items()}
    if not adapters:
        return model, cfgs
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    from lora_kit.loading import fix_bnb_cpu_repack
    for i, (name, path) in enumerate(adapters.items()):
        if i == 0:
            model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
        else:
            model.load_adapter(path, adapter_name=name, is_trainable=False)
        with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
            saved = set(f.keys())
        loaded = set(get_peft_model_state_dict(model, adapter_name=name))
        if saved != loaded:
            raise ValueError(f"adapter {name!r} at {path!r} loaded only in part: {sorted(loaded - saved)[:3]} were not "
                             f"in the file, {sorted(saved - loaded)[:3]} found no place in the base. Pass the base "
                             "the adapter was trained on, with the peft version that saved it "
                             f"({cfgs[name].get('peft_version', 'not recorded')}).")
    fix_bnb_cpu_repack(model)
    return model, cfgs
