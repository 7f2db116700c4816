"""The one settings definition.

Every knob of a lora_kit run is defined once here, with its default and a one-line docstring
(the comment after each field is extracted as its help text). Notebook ``parameters`` cells,
the CLI flags, the YAML params files and the widgets' choices are derived from or checked
against :class:`Settings` (``tests/test_settings_sync.py`` keeps them in sync).

Defaults describe the embedded default: the tiny model shipped with the package, on a CPU.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

METHODS = ("full", "lora", "qlora")
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd", "adafactor")
SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class Settings:
    # --- model and method -------------------------------------------------------------------
    model: str = "tiny"  # catalog name, local directory, hub id, or "tiny" (the embedded default)
    method: str = "lora"  # "full" | "lora" | "qlora" (4-bit NF4 base + LoRA)
    dtype: str = "float32"  # dtype the base weights are loaded in ("bfloat16" on a modern GPU)
    autocast: bool = False  # mixed-precision compute (fp32 master weights for method "full")
    double_quant: bool = True  # QLoRA: quantize the 4-bit quantization constants too
    trust_remote_code: bool = False  # run model code from the hub; off unless you trust the repo
    # --- adapter -------------------------------------------------------------------------
    lora_rank: int = 16  # LoRA rank r, higher means more capacity and more memory
    lora_alpha: int = 32  # LoRA scaling numerator (scale is alpha / rank)
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_targets: Any = "all-linear"  # "all-linear" or a list of module names, e.g. ["q_proj", "v_proj"]
    # --- step shape ----------------------------------------------------------------------
    seq_len: int = 64  # max tokens per example (longer examples are truncated and reported)
    batch_size: int = 16  # micro-batch per GPU per step
    grad_accum: int = 1  # gradient accumulation steps (does not change peak memory)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30 % slower
    attn_implementation: str = "sdpa"  # "sdpa" | "eager"
    optimizer: str = "adamw"  # adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | sgd | adafactor
    learning_rate: float = 2e-3  # peak learning rate
    # --- hardware ------------------------------------------------------------------------
    num_gpus: int = 1  # GPUs in the job (memory is per GPU)
    sharding: str = "none"  # none | ddp | zero1 | zero2 | zero3 | fsdp
    cpu_offload: bool = False  # offload sharded optimizer states (and zero3/fsdp params) to CPU
    plan_model: str = "llama-3.1-8b"  # model the planning notebooks size GPUs for ("same" means model), the tiny model fits anywhere
    gpu: str = "A100-80GB"  # GPU the plan targets (see lora_kit.plan.gpus.gpu_table())
    gpus: list = field(default_factory=lambda: ["T4", "L4", "A10G", "RTX-4090", "L40S", "A100-80GB", "H100-SXM"])  # GPUs to compare
    margin: float = 0.10  # safety margin: a plan "fits" when it uses at most (1 - margin) of the GPU
    # --- data ----------------------------------------------------------------------------
    dataset: str = "tiny:dates"  # "tiny:dates" (embedded), or a JSONL / CSV file / datasets folder
    prompt_field: str = "prompt"  # dataset column holding the prompt
    response_field: str = "response"  # dataset column holding the reference answer
    control_dataset: str = "tiny:control"  # prompts the fine-tune is not about (behaviour changes)
    base_mix: float = 0.0  # share of control-task examples mixed into training (limits forgetting)
    compare_base_mix: float = 0.25  # notebook 04 also trains an adapter with this share of base-task rows and compares (0 skips)
    # --- smoke run and evaluation --------------------------------------------------------
    max_steps: int = 300  # optimizer steps in the smoke run (the tutorial trains its adapter here)
    seed: int = 0  # seed set before the adapter is created and before data shuffling
    eval_examples: int = 200  # held-out examples to evaluate (0 means all)
    control_examples: int = 200  # control examples to evaluate (0 means all)
    max_new_tokens: int = 16  # generation budget, same for base and adapter
    # --- output --------------------------------------------------------------------------
    run_dir: str = "runs/default"  # where results, adapter, notebooks and the run card are written
    interactive: bool = True  # show ipywidgets panels (headless papermill runs set this to false)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Settings":
        return from_dict({**self.to_dict(), **changes})

    def planning_model(self) -> str:
        """The model the planning notebooks size GPUs for (``plan_model``, or ``model`` if "same")."""
        return self.model if self.plan_model == "same" else self.plan_model

    def estimate_kwargs(self) -> dict:
        """The subset of settings that ``lora_kit.memory.estimate`` / ``simulate`` accept."""
        keys = ("model", "method", "dtype", "autocast", "double_quant", "seq_len", "batch_size",
                "lora_rank", "lora_alpha", "lora_targets", "gradient_checkpointing",
                "attn_implementation", "optimizer", "num_gpus", "sharding", "cpu_offload")
        d = self.to_dict()
        return {k: d[k] for k in keys}


def field_help() -> dict[str, str]:
    """Field name -> the comment written after it in this file (used for CLI help and docs)."""
    src = inspect.getsource(Settings).splitlines()
    out = {}
    for line in src:
        s = line.strip()
        if ":" in s and "#" in s and not s.startswith("#"):
            name = s.split(":", 1)[0].strip()
            if name.isidentifier():
                out[name] = s.split("#", 1)[1].strip()
    return out


def field_names() -> list[str]:
    return [f.name for f in fields(Settings)]


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}.")


def validate(s: Settings) -> None:
    """Raise ValueError naming the field to change. Cheap checks only (no model loading)."""
    _check_choice("method", s.method, METHODS)
    _check_choice("dtype", s.dtype, DTYPES)
    _check_choice("optimizer", s.optimizer, OPTIMIZERS)
    _check_choice("sharding", s.sharding, SHARDINGS)
    _check_choice("attn_implementation", s.attn_implementation, ATTN_IMPLEMENTATIONS)
    for name in ("lora_rank", "lora_alpha", "seq_len", "batch_size", "grad_accum", "num_gpus", "max_steps",
                 "max_new_tokens"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    for name in ("eval_examples", "control_examples", "seed"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}.")
    if not 0 <= s.margin < 1:
        raise ValueError(f"margin must be in [0, 1), e.g. 0.10 for a 10 % safety margin; got {s.margin!r}.")
    for name in ("base_mix", "compare_base_mix"):
        if not 0 <= getattr(s, name) < 1:
            raise ValueError(f"{name} must be in [0, 1), e.g. 0.25 for a quarter of base-task rows; "
                             f"got {getattr(s, name)!r}.")
    if not 0 <= s.lora_dropout < 1:
        raise ValueError(f"lora_dropout must be in [0, 1), got {s.lora_dropout!r}.")
    if s.sharding != "none" and s.num_gpus < 2:
        raise ValueError(f"sharding={s.sharding!r} needs num_gpus > 1; set num_gpus or use sharding='none'.")
    if not (s.lora_targets == "all-linear" or (isinstance(s.lora_targets, (list, tuple))
                                               and s.lora_targets and all(isinstance(t, str) for t in s.lora_targets))):
        raise ValueError(f"lora_targets must be 'all-linear' or a non-empty list of module names, got {s.lora_targets!r}.")


def _coerce(name: str, value: Any) -> Any:
    """Coerce a string (CLI ``-p key value``) to the type of the field's default."""
    default = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
               for f in fields(Settings)}[name]
    if not isinstance(value, str) or isinstance(default, str) and name != "lora_targets":
        return value
    if isinstance(default, bool):
        if value.lower() in ("true", "1", "yes", "on"):
            return True
        if value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{name} expects true/false, got {value!r}.")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return type(default)(value) if isinstance(default, float) else int(value)
        except ValueError:
            raise ValueError(f"{name} expects a {type(default).__name__}, got {value!r}.") from None
    if name == "lora_targets" and value != "all-linear":
        return [t.strip() for t in value.strip("[]").replace("'", "").replace('"', "").split(",") if t.strip()]
    if isinstance(default, list):
        try:
            v = ast.literal_eval(value)
            return list(v) if isinstance(v, (list, tuple)) else [v]
        except (ValueError, SyntaxError):
            return [t.strip() for t in value.split(",") if t.strip()]
    return value


def from_dict(d: dict) -> Settings:
    """Build Settings from a dict; unknown keys raise with the list of valid ones."""
    valid = field_names()
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ValueError(f"Unknown setting(s) {unknown}; valid settings are: {', '.join(valid)}.")
    types = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields(Settings)}
    clean = {}
    for k, v in d.items():
        v = _coerce(k, v)
        t = types[k]
        if isinstance(t, bool) and not isinstance(v, bool):
            raise ValueError(f"{k} expects true/false, got {v!r}.")
        if isinstance(t, float) and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        clean[k] = v
    return Settings(**clean)


def load_settings(params_file: str | Path | None = None, overrides: dict | None = None) -> Settings:
    """Settings from a YAML params file plus ``overrides`` (later wins), validated."""
    d: dict = {}
    if params_file is not None:
        import yaml
        p = Path(params_file)
        if not p.is_file():
            raise ValueError(f"params file {str(p)!r} does not exist.")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"params file {str(p)!r} must hold a mapping of setting: value.")
        d.update(loaded)
    d.update(overrides or {})
    return from_dict(d)
