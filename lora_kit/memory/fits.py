"""Where fitted steps live: one file per (architecture, categorical settings), found by key.

A fit (:mod:`lora_kit.memory.calibrate`) depends on the architecture (the config, its depth and layer pattern
aside: those are the fit's variables), on the settings that change the operator sequence (method, dtype, autocast,
double quant, LoRA targets, checkpointing, attention, optimizer, padding, loop), on the device semantics ("cpu":
``simulate`` runs the CPU kernels) and on the library versions whose code ``simulate`` runs (torch, transformers,
peft, bitsandbytes). The file name is a digest of everything but the versions; the versions are stored in the
file, so a fit made with other versions is still found, used, and said to be ("fitted with transformers 5.24;
installed 5.25: ``lora-kit fit <model>`` refits").

Two places, searched in order: the user's cache (``$LORA_KIT_FITS``, default ``~/.cache/lora_kit/fits``), where a
fit made on demand is written (atomically), and the fits shipped with the package (``lora_kit/catalog/fits``,
built by ``benchmarks/fit_catalog.py``). ``$LORA_KIT_FIT`` says what a miss does: ``auto`` (default) fits it on the
spot (seconds for a small model, up to a minute for an 8B-class one on 2 cores) and keeps it in the user's cache;
``never`` raises, naming the ``lora-kit fit`` command that makes it (CI, or a batch job that must not spend the
time).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

from lora_kit.memory.calibrate import Fit

SHIPPED = Path(__file__).resolve().parents[1] / "catalog" / "fits"
DEVICE = "cpu"
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")
# config entries that do not change one block's operators: names, versions, the depth and layer pattern (variables)
NOT_ARCHITECTURE = ("_name_or_path", "name_or_path", "transformers_version", "architectures", "num_hidden_layers",
                    "layer_types", "dtype", "torch_dtype", "output_attentions", "output_hidden_states", "use_cache")
_MEMO: dict = {}


def user_dir() -> Path:
    return Path(os.environ.get("LORA_KIT_FITS") or Path.home() / ".cache" / "lora_kit" / "fits").expanduser()


@lru_cache(maxsize=1)
def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = None
    return out


def categorical(step) -> dict:
    """The step fields a fit holds fixed (the others are its variables, or composed: sharding and GPUs, but for
    FSDP2's own step, fitted per GPU count)."""
    from lora_kit.memory.calibrate import fsdp_step, rank_is_variable
    lora = step.method != "full"
    fixed_rank = {"lora_rank": step.lora_rank} if lora and not rank_is_variable(step) else {}
    sharded = {"sharding": "fsdp", "num_gpus": step.num_gpus} if fsdp_step(step) else {}  # FSDP2's step, per count
    # QLoRA without peft's up-casts (sharded QLoRA's recipe) is its own step; the usual one keeps its old key
    bare = {"qlora_prepare": "none"} if step.method == "qlora" and not step.kbit_prepared else {}
    liger = {"liger_kernel": True} if step.liger_kernel else {}  # its own step; without it the keys stay as they were
    # LoRA dropout above 0 keeps a mask and a dropped input per adapter (its rate changes no size): its own step
    dropout = {"lora_dropout": True} if lora and step.lora_dropout > 0 else {}
    return {**fixed_rank, **sharded, **bare, **liger, **dropout, "method": step.method, "dtype": step.dtype, "autocast": step.autocast,
            "double_quant": step.double_quant if step.method == "qlora" else None,
            "lora_targets": list(step.lora_targets) if lora and not isinstance(step.lora_targets, str)
            else (step.lora_targets if lora else None),
            "gradient_checkpointing": step.gradient_checkpointing, "attn_implementation": step.attn_implementation,
            "optimizer": step.optimizer, "padding": step.padding, "loop": step.loop}


_ARCH: dict = {}


def _filled(config: dict) -> tuple[dict, tuple | None]:
    """(the config as transformers fills it, less what does not change one block's operators; its layer types)."""
    raw = json.dumps(config, sort_keys=True, default=str)
    if raw not in _ARCH:
        from lora_kit.memory.specs import load_config
        full = json.loads(load_config(config).to_json_string(use_diff=False))
        types = full.get("layer_types")
        _ARCH[raw] = ({k: v for k, v in sorted(full.items()) if k not in NOT_ARCHITECTURE},
                      tuple(types) if isinstance(types, list) and types else None)
    return _ARCH[raw]


def architecture(config: dict) -> dict:
    """The config as transformers fills it (so a catalog entry and the same model's config.json agree), less what
    does not change one block's operators."""
    return _filled(config)[0]


def layer_types(config: dict) -> tuple | None:
    """The model's layer types as transformers fills them (a catalog entry may not list them)."""
    return _filled(config)[1]


def key(config: dict, step) -> dict:
    return {"architecture": architecture(config), "settings": categorical(step), "device": DEVICE}


def digest(k: dict) -> str:
    return hashlib.sha256(json.dumps(k, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _path(folder: Path, config: dict, d: str) -> Path:
    return folder / f"{config.get('model_type', 'model')}-{d}.json.gz"


def stored_path(config: dict, step, folder: Path) -> Path:
    """Where the fit of ``config`` x ``step`` is stored in ``folder``."""
    return _path(folder, config, digest(key(config, step)))


def lookup(config: dict, step) -> tuple[Fit, dict] | None:
    """The stored fit for ``config`` and ``step`` with what it was fitted with (``versions``, ``seconds``), or
    None."""
    d = digest(key(config, step))
    memo = (str(user_dir()), d)  # the same fit can be in another cache folder, or in none
    if memo in _MEMO:
        return _MEMO[memo]
    for folder in (user_dir(), SHIPPED):
        p = _path(folder, config, d)
        if p.is_file():
            data = json.loads(gzip.decompress(p.read_bytes()))
            _MEMO[memo] = (Fit.from_json(data["fit"]), {k: data[k] for k in ("versions", "seconds", "where")})
            return _MEMO[memo]
    return None


class MissingFit(ValueError):
    """No stored fit for a model and step, and ``$LORA_KIT_FIT=never``."""


def should_fit() -> bool:
    """On a miss, fit now? (``$LORA_KIT_FIT``; see the module docstring)."""
    when = os.environ.get("LORA_KIT_FIT", "auto")
    if when not in ("auto", "never"):
        raise ValueError(f"LORA_KIT_FIT={when!r}: use 'auto' (fit a missing memory fit on the spot) or 'never'.")
    return when == "auto"


def describe(step) -> str:
    """The step's fitted settings as ``lora-kit fit`` flags (what a missing fit needs)."""
    held = {k: v for k, v in categorical(step).items() if v is not None}
    held.update({k: getattr(step, k) for k in ("sharding", "num_gpus") if k in held})
    return " ".join(f"--{k.replace('_', '-')} {','.join(v) if isinstance(v, list) else v}" for k, v in held.items())


def make(config: dict, step, folder: Path | None = None, show: str | None = None) -> tuple[Fit, dict]:
    """Fit ``config`` x ``step`` now (``simulate`` on shallow, short steps) and store it in ``folder`` (default: the
    user's cache); ``show``: a progress bar's title (None: no bar). Returns (fit, info)."""
    import time

    from lora_kit.memory.calibrate import fit
    from lora_kit.memory.specs import load_config
    from lora_kit.progress import bar
    k = key(config, step)
    d = digest(k)
    t0 = time.perf_counter()
    with bar(1, show or "", enabled=show is not None, unit="simulated step") as pb:
        def progress(done, total):
            pb.total = total
            pb.update(1)
        f = fit(load_config(config), step, progress=progress)
    info = {"versions": versions(), "seconds": round(time.perf_counter() - t0, 1), "where": _machine()}
    folder = user_dir() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    p = _path(folder, config, d)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_bytes(gzip.compress(json.dumps({"key": k, **info, "fit": f.to_json()}, separators=(",", ":")).encode(),
                                  mtime=0))
    os.replace(tmp, p)
    if folder == user_dir():
        _MEMO[(str(folder), d)] = (f, info)
    return f, info


def version_note(info: dict) -> str | None:
    """What differs between the libraries a fit was made with and the installed ones (None: nothing)."""
    now = versions()
    diff = [f"{lib} {info['versions'].get(lib)} (installed {now[lib]})" for lib in LIBRARIES
            if info["versions"].get(lib) != now[lib]]
    if not diff:
        return None
    return ("fitted with " + ", ".join(diff) + "; `lora-kit fit <model>` refits for the installed libraries.")


def _machine() -> str:
    import platform
    return f"{platform.machine()} {os.cpu_count()} cpus"
