"""The one settings definition, and the one step schema and validator.

Every knob of a lora_kit run is defined once here, in :class:`Settings`, with its default and a
one-line comment (extracted as its help text). Notebook ``parameters`` cells, the CLI flags, the
YAML params files and the widgets' choices are derived from or checked against it
(``tests/test_settings.py`` and ``tests/test_step_schema.py`` keep them in sync).

**The step schema.** The settings that define one training step's memory -- :data:`STEP_FIELDS` --
are checked by one validator, :func:`check_step`, which :class:`Settings`, ``estimate``,
``simulate``, ``measure_config``, the planner, the OOM advice and the CLI all call; nothing else
re-checks them. Two honest default sets, each stated where it applies:

- :data:`EMBEDDED_DEFAULTS` (the :class:`Settings` defaults): the tiny model shipped in the
  package, trained on a CPU in minutes -- float32, 64 tokens, micro-batch 16, no checkpointing.
- :data:`PLANNING_DEFAULTS` (the defaults of ``estimate`` / ``simulate`` / ``measure_config`` and of
  ``lora-kit estimate``): planning a real model on a GPU -- bfloat16 weights, 2048 tokens,
  micro-batch 1, gradient checkpointing on (the planner's first no-quality-cost saving), AdamW.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

TINY_ALIASES = ("tiny", "lora_kit:tiny", "embedded")  # names of the embedded model
METHODS = ("full", "lora", "qlora")
METHOD_LABELS = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}  # one spelling in tables, figures, texts


def method_label(method) -> str:
    """One spelling of a method everywhere: "full", "LoRA", "QLoRA"."""
    return METHOD_LABELS.get(str(method).lower(), str(method))


DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd", "adafactor")
SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
PADDINGS = ("none", "longest", "max_length")
LOOPS = ("kit", "trainer", "sft")  # lora_kit's step | transformers' Trainer | TRL's SFTTrainer, each with its defaults
DATA_FORMATS = ("auto", "prompt_response", "alpaca", "messages")
PROMPT_FORMATS = ("auto", "plain", "chat")  # or a user template holding {prompt}
LONG_EXAMPLES = ("truncate", "drop", "error")
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

# The fields that define one training step (``model`` aside), in the order of estimate's signature.
STEP_FIELDS = ("method", "dtype", "autocast", "double_quant", "seq_len", "batch_size", "lora_rank", "lora_alpha",
               "lora_targets", "gradient_checkpointing", "attn_implementation", "optimizer", "num_gpus", "sharding",
               "cpu_offload", "grad_accum", "padding", "loop")
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")  # meaningless with method="full"
CHOICES = {"method": METHODS, "dtype": DTYPES, "attn_implementation": ATTN_IMPLEMENTATIONS, "optimizer": OPTIMIZERS,
           "sharding": SHARDINGS, "padding": PADDINGS, "loop": LOOPS}
BOOLS = ("autocast", "double_quant", "gradient_checkpointing", "cpu_offload")
# positive integers and the largest value that makes sense (beyond it a typo is likelier than a plan)
INT_BOUNDS = {"seq_len": 1 << 24, "batch_size": 1 << 16, "lora_rank": 1 << 16, "lora_alpha": 1 << 20,
              "num_gpus": 1 << 16, "grad_accum": 1 << 16}
PLANNING_DEFAULTS = dict(method="lora", dtype="bfloat16", autocast=False, double_quant=True, seq_len=2048,
                         batch_size=1, lora_rank=16, lora_alpha=32, lora_targets="all-linear",
                         gradient_checkpointing=True, attn_implementation="sdpa", optimizer="adamw", num_gpus=1,
                         sharding="none", cpu_offload=False, grad_accum=1, padding="none", loop="kit")


def parse_bool(name: str, value: Any) -> bool:
    """A boolean setting: True/False, or one of the words the CLI accepts; anything else is refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def _check_int(name: str, value: Any, lo: int = 1, hi: int | None = None):
    """A bounded integer setting (scalar, or a numpy array of them for sweeps)."""
    hi = INT_BOUNDS.get(name) if hi is None else hi
    arr = np.asarray(value)
    ok = arr.dtype.kind in "iu" and arr.size > 0 and not isinstance(value, (bool, np.bool_))
    if ok and (arr.min() < lo or (hi is not None and arr.max() > hi)):
        ok = False
    if not ok:
        if arr.ndim and arr.size:  # a sweep axis: name the first offending value
            bad = [v for v in arr.ravel().tolist() if not isinstance(v, int) or v < lo or (hi is not None and v > hi)]
            value = bad[0] if bad else value
        kind = "a positive integer" if lo == 1 else "a non-negative integer" if lo == 0 else f"an integer >= {lo}"
        raise ValueError(f"{name} must be {kind}" + (f" (at most {hi:,})" if hi is not None else "") + f", got {value!r}.")
    return int(value) if arr.ndim == 0 else value


def _check_targets(value: Any):
    if value == "all-linear":
        return value
    if isinstance(value, str) and value.strip():
        value = [t.strip() for t in value.strip("[]").replace("'", "").replace('"', "").split(",") if t.strip()]
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, str) and t for t in value):
        return list(value)
    raise ValueError(f"lora_targets must be 'all-linear' or a non-empty list of module names, e.g. "
                     f"['q_proj', 'v_proj']; got {value!r}.")


def check_count(name: str, value: Any):
    """A number of examples to evaluate: a non-negative integer, 0 (or None) meaning all of them.
    The one check for ``Settings.eval_examples`` / ``control_examples`` and ``evaluate``'s ``n_heldout`` /
    ``n_control`` (``-1`` was once read as "all but the last")."""
    return None if value is None else _check_int(name, value, 0, (1 << 32) - 1)


def check_heldout_split(split: Any) -> Any:
    """A held-out split must not be the split the adapter trained on: evaluating on ``"train"`` and
    calling it held-out reports memorisation as skill."""
    if isinstance(split, str) and split.strip().lower() == "train":
        raise ValueError("heldout_split='train' is the training split, so the result would not be held-out; "
                         "choose a split the adapter did not train on (e.g. 'test'), or pass the rows "
                         "you held out as heldout=...")
    return split


def did_you_mean(value, choices) -> str:
    """" (did you mean 'x'?)" when ``value`` is a near miss of one of ``choices`` (a typo), else ""."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value, choices) -> None:
    """The one message for a value outside its choices: what was given, the nearest choice, all choices."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid{did_you_mean(value, choices)}; "
                         f"choose one of {', '.join(map(repr, choices))}.")


def check_step(values: dict, defaults: dict | None = None) -> dict:
    """The one validator of step settings: ``values`` (any subset of :data:`STEP_FIELDS`, plus extra
    keys passed through) checked and normalised; missing fields come from ``defaults``
    (:data:`PLANNING_DEFAULTS` unless given). Raises ValueError naming the setting to change.

    Checks: choices; booleans (True/False or CLI words, nothing else); integers bounded to what
    makes sense (numpy arrays allowed for sweeps); LoRA settings left at their defaults with
    ``method="full"``; sharding needs several GPUs; CPU offload needs sharded states. What needs
    the model (target names, rank vs layer width) is checked by ``lora_kit.memory.specs.check_targets``.
    """
    defaults = PLANNING_DEFAULTS if defaults is None else defaults
    s = {**{k: defaults[k] for k in STEP_FIELDS if k in defaults}, **values}
    for name, choices in CHOICES.items():
        check_choice(name, s[name], choices)
    for name in BOOLS:
        s[name] = parse_bool(name, s[name])
    for name in INT_BOUNDS:
        s[name] = _check_int(name, s[name])
    s["lora_targets"] = _check_targets(s["lora_targets"])
    if s["method"] == "full":
        changed = [k for k in LORA_FIELDS if s[k] != PLANNING_DEFAULTS[k] and np.any(s[k] != PLANNING_DEFAULTS[k])]
        if changed:
            raise ValueError(f"{', '.join(changed)} only appl{'y' if len(changed) > 1 else 'ies'} to method='lora' "
                             f"or 'qlora'; leave "
                             f"{'them' if len(changed) > 1 else 'it'} at the default with method='full', "
                             "or choose a LoRA method.")
    if s["sharding"] != "none" and np.any(np.asarray(s["num_gpus"]) < 2):
        raise ValueError(f"sharding={s['sharding']!r} needs num_gpus > 1; set num_gpus or use sharding='none'.")
    if s["cpu_offload"] and s["sharding"] not in ("zero1", "zero2", "zero3", "fsdp"):
        raise ValueError("cpu_offload=True needs sharding='zero1', 'zero2', 'zero3' or 'fsdp'; set sharding, "
                         "or cpu_offload=False.")
    return s


def step_kwargs(source, method: str | None = None) -> dict:
    """The step fields of ``source`` (Settings or dict), ready for estimate / simulate / measure:
    with ``method`` (default: the source's), LoRA fields are left out for method="full"."""
    d = source.to_dict() if hasattr(source, "to_dict") else dict(source)
    out = {k: d[k] for k in STEP_FIELDS if k in d}
    if method is not None:
        out["method"] = method
    if out.get("method") == "full":
        out = {k: v for k, v in out.items() if k not in LORA_FIELDS}
    return out


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
    padding: str = "max_length"  # batch padding: "max_length" (to seq_len, as the smoke run) | "longest" | "none"
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30 % slower
    attn_implementation: str = "sdpa"  # "sdpa" | "eager"
    optimizer: str = "adamw"  # adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | sgd | adafactor
    loop: str = "kit"  # training loop the memory figures are for: "kit" (lora_kit's step) | "trainer" (HF Trainer) | "sft" (TRL SFTTrainer)
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
    data_format: str = "auto"  # "auto" | "prompt_response" | "alpaca" (instruction/input/output) | "messages" (role/content lists)
    messages_field: str = "messages"  # dataset column holding the conversation when data_format is "messages"
    prompt_format: str = "auto"  # "auto" | "plain" (prompt, newline, "Answer: ") | "chat" (the tokenizer's chat template) | a template with {prompt}
    long_examples: str = "truncate"  # examples longer than seq_len: "truncate" | "drop" | "error"
    heldout_dataset: str = ""  # held-out file/folder for evaluation (empty: the embedded test split, or heldout_fraction of dataset)
    heldout_fraction: float = 0.1  # share of dataset held out (split by seed) when heldout_dataset is empty and dataset is your own
    control_dataset: str = "auto"  # prompts the fine-tune is not about ("auto": tiny:control for tiny, the shipped generic:control otherwise)
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
        """``model`` plus the step fields: the arguments ``estimate`` / ``simulate`` accept."""
        return {"model": self.model, **step_kwargs(self)}

EMBEDDED_DEFAULTS = {f.name: f.default for f in fields(Settings) if f.name in STEP_FIELDS}


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


def validate(s: Settings) -> None:
    """Raise ValueError naming the field to change. Cheap checks only (no model loading); the step
    fields go through :func:`check_step`, the same validator ``estimate`` and ``simulate`` use."""
    step = check_step({k: getattr(s, k) for k in STEP_FIELDS}, EMBEDDED_DEFAULTS)
    for k, v in step.items():
        setattr(s, k, v)
    for name in ("max_steps", "max_new_tokens"):
        setattr(s, name, _check_int(name, getattr(s, name), 1, 1 << 24))
    for name in ("eval_examples", "control_examples"):
        setattr(s, name, check_count(name, getattr(s, name)))
    s.seed = _check_int("seed", s.seed, 0, (1 << 32) - 1)
    for name in ("autocast", "double_quant", "trust_remote_code", "interactive"):
        setattr(s, name, parse_bool(name, getattr(s, name)))
    lr = s.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not 0 < lr < 1:
        raise ValueError(f"learning_rate must be a number in (0, 1), e.g. 2e-4; got {lr!r}.")
    if s.method == "full" and s.lora_dropout != 0.0:
        raise ValueError("lora_dropout only applies to method='lora' or 'qlora'; leave it at 0 with method='full'.")
    if not 0 <= s.margin < 1:
        raise ValueError(f"margin must be in [0, 1), e.g. 0.10 for a 10 % safety margin; got {s.margin!r}.")
    for name in ("base_mix", "compare_base_mix"):
        if not 0 <= getattr(s, name) < 1:
            raise ValueError(f"{name} must be in [0, 1), e.g. 0.25 for a quarter of base-task rows; "
                             f"got {getattr(s, name)!r}.")
    if not 0 <= s.lora_dropout < 1:
        raise ValueError(f"lora_dropout must be in [0, 1), got {s.lora_dropout!r}.")
    for name, choices in (("data_format", DATA_FORMATS), ("long_examples", LONG_EXAMPLES)):
        check_choice(name, getattr(s, name), choices)
    if s.prompt_format not in PROMPT_FORMATS and "{prompt}" not in str(s.prompt_format):
        raise ValueError(f"prompt_format={s.prompt_format!r} is not valid; choose 'auto', 'plain', 'chat' or a template "
                         "holding {prompt}, e.g. '### Question: {prompt}\\n### Answer: '.")
    hf = s.heldout_fraction
    if isinstance(hf, bool) or not isinstance(hf, (int, float)) or not 0 < hf < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), e.g. 0.1 to hold out 10 % of dataset; got {hf!r}.")
    for name in ("dataset", "prompt_field", "response_field", "messages_field", "control_dataset"):
        if not isinstance(getattr(s, name), str) or not getattr(s, name).strip():
            raise ValueError(f"{name} must be a non-empty string, got {getattr(s, name)!r}.")
    if not isinstance(s.heldout_dataset, str):
        raise ValueError(f"heldout_dataset must be a path (or '' for a split of dataset), got {s.heldout_dataset!r}.")


def coerce_value(name: str, value: Any) -> Any:
    """Coerce a string (CLI ``-p key value``) to the type of the field's default."""
    default = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
               for f in fields(Settings)}[name]
    if not isinstance(value, str) or isinstance(default, str) and name != "lora_targets":
        return value
    if isinstance(default, bool):
        return parse_bool(name, value)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return type(default)(value) if isinstance(default, float) else int(value)
        except ValueError:
            raise ValueError(f"{name} expects a {type(default).__name__}, got {value!r}.") from None
    if name == "lora_targets":
        return _check_targets(value)
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
        hints = "".join(f" {k!r}{did_you_mean(k, valid) or ' (no close name)'}" for k in unknown)
        raise ValueError(f"Unknown setting(s):{hints}; valid settings are: {', '.join(valid)}.")
    types = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields(Settings)}
    clean = {}
    for k, v in d.items():
        v = coerce_value(k, v)
        t = types[k]
        if isinstance(t, bool):
            v = parse_bool(k, v)
        if isinstance(t, float) and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        clean[k] = v
    return Settings(**clean)


def read_params(params_file: str | Path) -> dict:
    """The settings mapping in a YAML params file; ValueError names the file, and the line for bad
    YAML (python tags and other non-plain YAML are refused: ``yaml.safe_load``) or bad encoding."""
    import yaml
    p = Path(params_file)
    if not p.is_file():
        raise ValueError(f"params file {str(p)!r} does not exist.")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"params file {str(p)!r} is not UTF-8 text (line {line}); save it as UTF-8.") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"params file {str(p)!r} is not valid YAML{where}: {problem}.") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"params file {str(p)!r} must hold a mapping of setting: value.")
    return loaded


def load_settings(params_file: str | Path | None = None, overrides: dict | None = None) -> Settings:
    """Settings from a YAML params file plus ``overrides`` (later wins), validated."""
    d: dict = read_params(params_file) if params_file is not None else {}
    d.update(overrides or {})
    return from_dict(d)
