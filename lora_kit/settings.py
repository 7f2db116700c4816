"""The one settings definition: the :class:`Step` schema, its two named default sets, and :class:`Settings`.

:class:`Step` (frozen) defines one training step: every field once, with its meaning, unit, allowed values,
default and why (``Step.doc(name)``), validated once when a ``Step`` is made. ``estimate``, ``simulate``,
``measure_config``, the planner, the time model, the smoke run, the CLI flags, the params keys and
:class:`Settings` all derive from it: a new ``Step`` field is a flag and a params key with no other edit.
A sweep is a ``Step`` plus the integer fields it varies (:func:`check_axes`), validated by the same rules.

Two default sets, one per purpose: :data:`PLANNING` (the ``Step`` defaults: planning a real model on a
rented GPU) and :data:`EMBEDDED` (the embedded tiny model's CPU journey, :data:`EMBEDDED_CHANGES` gives each
difference with its reason). :class:`Settings` is a run: the step fields with the embedded defaults, plus the
model, data, evaluation and output settings (:class:`RunFields`).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

TINY_ALIASES = ("tiny", "lora_kit:tiny", "embedded")  # names of the embedded model
EMBEDDED_PLAN_MODEL = "llama-3.1-8b"  # what the embedded tutorial plans: the tiny model itself fits any GPU
METHODS = ("full", "lora", "qlora")
METHOD_LABELS = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}  # one spelling in tables, figures, texts


def method_label(method) -> str:
    """One spelling of a method everywhere: "full", "LoRA", "QLoRA"."""
    return METHOD_LABELS.get(str(method).lower(), str(method))


DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd", "adafactor")
SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
PADDINGS = ("none", "longest", "max_length", "packed")
LOOPS = ("kit", "trainer", "sft")  # lora_kit's step | transformers' Trainer | TRL's SFTTrainer, each with its defaults
DATA_FORMATS = ("auto", "prompt_response", "alpaca", "messages", "sharegpt", "prompt_completion", "text")
TRAIN_ON = ("assistant", "last", "all")  # conversation tokens trained (lora_kit.prompting)
THINK = ("answer", "whole")  # what is judged of a reasoning template's generated answer (lora_kit.generation)
PROMPT_FORMATS = ("auto", "plain", "chat")  # or a user template holding {prompt}
LONG_EXAMPLES = ("truncate", "drop", "error")
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
SHARDED_STATES = ("zero1", "zero2", "zero3", "fsdp")  # shardings that split optimizer states over the GPUs
SHARDED_WEIGHTS = ("zero3", "fsdp")  # shardings that split the weights: sharded QLoRA skips peft's up-casts
QLORA_PREPARES = ("auto", "peft", "none")


def parse_bool(name: str, value: Any) -> bool:
    """A boolean setting: True/False, or one of the words the CLI accepts; anything else is refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def _check_int(name: str, value: Any, lo: int = 1, hi: int | None = None):
    """A bounded integer setting (scalar, or a numpy array of them for sweeps)."""
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
    return int(value) if arr.ndim == 0 else arr.astype(np.int64)


def _check_targets(value: Any):
    """"all-linear", or a tuple of module names (a list, a tuple or the CLI's "q_proj,v_proj")."""
    if value == "all-linear":
        return value
    if isinstance(value, str) and value.strip():
        value = [t.strip() for t in value.strip("[]()").replace("'", "").replace('"', "").split(",") if t.strip()]
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, str) and t for t in value):
        return tuple(value)
    raise ValueError(f"lora_targets must be 'all-linear' or a non-empty list of module names, e.g. "
                     f"['q_proj', 'v_proj']; got {value!r}.")


def check_count(name: str, value: Any):
    """A number of examples to evaluate: a non-negative integer, 0 (or None) meaning all of them.
    The one check for ``Settings.eval_examples`` / ``control_examples`` and ``evaluate``'s ``n_heldout`` /
    ``n_control``."""
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


def check_names(given, valid, what: str = "setting") -> None:
    """Unknown names refused with "did you mean ..." for each and the list of valid ones."""
    unknown = [k for k in given if k not in valid]
    if unknown:
        hints = "".join(f" {k!r}{did_you_mean(k, valid) or ' (no close name)'}" for k in unknown)
        raise ValueError(f"Unknown {what}(s):{hints}; valid {what}s are: {', '.join(valid)}.")


def setting(default, doc: str, *, choices=None, kind: str | None = None, most: int | None = None,
            lora: bool = False, factory=None):
    """A settings field: its default and its documentation (meaning, unit, allowed values, why this default),
    plus the rule :class:`Step` validates it by (``kind``: "choice" | "bool" | "int" (1 .. ``most``) |
    "targets" | "fraction" (a number in [0, 1)). ``lora``: the field only applies to LoRA / QLoRA."""
    kind = "choice" if choices else kind
    meta = {"doc": doc, "kind": kind, "choices": choices, "most": most, "lora": lora}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _check_field(f: dataclasses.Field, value):
    m = f.metadata
    if m["kind"] == "choice":
        check_choice(f.name, value, m["choices"])
    elif m["kind"] == "bool":
        return parse_bool(f.name, value)
    elif m["kind"] == "int":
        return _check_int(f.name, value, 1, m["most"])
    elif m["kind"] == "targets":
        return _check_targets(value)
    elif m["kind"] == "fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"{f.name} must be a number in [0, 1), e.g. 0.05; got {value!r}.")
        return float(value)
    return value


@dataclass(frozen=True)
class Step:
    """One training step, per GPU: everything that sets its memory and time (``model`` aside).

    The defaults are :data:`PLANNING`'s: planning a real model on a rented GPU. Made once, validated once;
    a bad value raises ValueError naming the field and its allowed values. ``Step.doc(name)`` is a field's
    documentation; ``step.replace(**changes)`` a changed copy (unknown names: "did you mean ...").
    """
    method: str = setting("lora", "Fine-tuning method: 'full' trains every weight; 'lora' trains low-rank adapters "
                          "on frozen weights; 'qlora' is LoRA on a 4-bit NF4 base (bitsandbytes). Default 'lora': "
                          "the usual choice for a 7-8B model on one GPU.", choices=METHODS)
    dtype: str = setting("bfloat16", "Dtype the base weights are loaded in: 'float32' | 'bfloat16' | 'float16'. "
                         "Default 'bfloat16': what every current training GPU computes fastest.", choices=DTYPES)
    autocast: bool = setting(False, "Mixed-precision compute (torch.autocast in 16-bit; fp32 master weights when "
                             "method='full'). Default false: weights are loaded in dtype and computed in it.",
                             kind="bool")
    qlora_prepare: str = setting("auto", "QLoRA only: how the 4-bit model is readied. 'peft': peft's "
                                 "prepare_model_for_kbit_training (norms, embeddings and lm_head up-cast to fp32, "
                                 "and with them the residual stream; fp32 adapters), the QLoRA paper's and "
                                 "peft's recipe | 'none': no up-casts, bf16 adapters, 4-bit storage in dtype, what "
                                 "TRL 1.16's SFTTrainer and Answer.AI's fsdp_qlora do (FSDP and ZeRO-3 can then shard "
                                 "the 4-bit weights). Default 'auto': 'none' with loop 'sft' or sharding 'fsdp' / "
                                 "'zero3', else 'peft'.",
                                 choices=QLORA_PREPARES)
    double_quant: bool = setting(True, "QLoRA only: also quantise the 4-bit quantisation constants "
                                 "(bitsandbytes' bnb_4bit_use_double_quant). Default true, as in the QLoRA paper.",
                                 kind="bool")
    seq_len: int = setting(2048, "Tokens per row (the padded or longest length), 1 to 16,777,216. Default 2048: "
                           "a common instruction-tuning length; plan for your data's longest example.",
                           kind="int", most=1 << 24)
    batch_size: int = setting(1, "Micro-batch: rows per GPU per forward/backward, 1 to 65,536. Default 1: the "
                              "smallest step; raise it (or grad_accum) once it fits.", kind="int", most=1 << 16)
    lora_rank: int = setting(16, "LoRA rank r (LoRA/QLoRA only), 1 to 65,536: adapter capacity, memory and time "
                             "grow with it. Default 16, a common choice (peft's default is 8).", kind="int",
                             most=1 << 16, lora=True)
    lora_alpha: int = setting(32, "LoRA scaling numerator (scale = alpha / rank; LoRA/QLoRA only), 1 to 1,048,576. "
                              "Costs no memory. Default 32 = 2 x rank.", kind="int", most=1 << 20, lora=True)
    lora_targets: Any = setting("all-linear", "Modules LoRA adapts (LoRA/QLoRA only): 'all-linear' (every linear "
                                "of the blocks, as peft; lm_head excluded) or a list of module names, e.g. "
                                "['q_proj', 'v_proj']. Default 'all-linear': the QLoRA paper's finding that adapting "
                                "every linear matters most.", kind="targets", lora=True)
    lora_dropout: float = setting(0.0, "Dropout on each LoRA adapter's input (LoRA/QLoRA only), 0 to below 1. Above "
                                  "0 every adapted linear keeps a dropped copy of its input and the dropout's mask "
                                  "for backward, and the step runs those kernels. Default 0.0, peft's (the QLoRA "
                                  "paper used 0.05-0.1).", kind="fraction", lora=True)
    gradient_checkpointing: bool = setting(True, "Recompute each block's activations in backward (non-reentrant, as "
                                           "the HF Trainer): much less memory, about 30 % more time. Default true: "
                                           "the first saving a plan makes, at no cost in quality.", kind="bool")
    attn_implementation: str = setting("sdpa", "Attention kernel: 'sdpa' (torch's scaled_dot_product_attention) | "
                                       "'eager' (materialised scores) | 'flash_attention_2' (the flash-attn package, "
                                       "CUDA only: bf16/fp16 q/k/v, so QLoRA's fp32 q/k/v are cast, and never the "
                                       "S x S fallback; planned for padding='none', emulated on a CPU). "
                                       "Default 'sdpa', transformers' default.",
                                       choices=ATTN_IMPLEMENTATIONS)
    optimizer: str = setting("adamw", "Optimizer: adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit | sgd | "
                             "adafactor (8-bit and paged ones from bitsandbytes). Default 'adamw' "
                             "(torch.optim.AdamW, foreach), what the HF Trainer uses.", choices=OPTIMIZERS)
    num_gpus: int = setting(1, "GPUs in the job, 1 to 65,536; every figure is per GPU. Default 1.", kind="int",
                            most=1 << 16)
    sharding: str = setting("none", "How several GPUs share the job: none | ddp (replicas) | zero1 | zero2 | zero3 "
                            "(DeepSpeed) | fsdp (PyTorch FSDP2). Anything but 'none' needs num_gpus > 1. "
                            "Default 'none'.", choices=SHARDINGS)
    cpu_offload: bool = setting(False, "Keep sharded optimizer states (and zero3/fsdp parameters) in CPU memory; "
                                "needs sharding zero1/zero2/zero3/fsdp. Default false.", kind="bool")
    grad_accum: int = setting(1, "Gradient accumulation micro-steps per optimizer step, 1 to 65,536: multiplies "
                              "tokens per update, not peak memory. Default 1.", kind="int", most=1 << 16)
    padding: str = setting("none", "How rows are batched: 'none' (every row exactly seq_len tokens, no attention "
                           "mask) | 'longest' / 'max_length' (padded rows with a mask) | 'packed' (padding-free: "
                           "the batch's rows concatenated into one, position_ids restarting per row, no mask, as "
                           "TRL's padding_free; with attn_implementation='flash_attention_2'). Default 'none': a plan "
                           "sizes full rows of seq_len tokens, the worst case, and padding adds only the mask (under "
                           "flash_attention_2, the unpad path's gathered copies of the real tokens).",
                           choices=PADDINGS)
    loop: str = setting("kit", "Training loop the figures describe and the smoke run runs: 'kit' (lora_kit's step) | "
                        "'trainer' (transformers' Trainer, its train()) | 'sft' (TRL's SFTTrainer, its train()), "
                        "each with its own defaults. "
                        "Default 'kit'.", choices=LOOPS)
    liger_kernel: bool = setting(False, "Liger Kernel's Triton kernels in the loop: the Trainer's / TRL's "
                                 "use_liger_kernel=True, axolotl's liger plugin. For Llama, Mistral and Qwen2/3 "
                                 "they fuse RoPE, RMSNorm and SwiGLU and compute the loss with a fused linear "
                                 "cross-entropy that never holds the full (tokens x vocabulary) logits, only a chunk "
                                 "of them, and its gradients in forward: much less memory at large vocabularies; "
                                 "the same matmuls, in chunks that each read lm_head's weight again (TRL's "
                                 "SFTTrainer keeps its own fused head: the layer kernels only). Needs a CUDA GPU and "
                                 "liger-kernel. Default false: neither the Trainer nor TRL turns it on.", kind="bool")

    def __post_init__(self):
        for name, value in check_values({f.name: getattr(self, f.name) for f in fields(self)}).items():
            object.__setattr__(self, name, value)

    @staticmethod
    def doc(name: str) -> str:
        """A field's documentation."""
        return STEP_FIELD[name].metadata["doc"]

    def to_dict(self) -> dict:
        """The fields as plain values (``lora_targets`` as a list), for JSON records and keyword arguments."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(d["lora_targets"], tuple):
            d["lora_targets"] = list(d["lora_targets"])
        return d

    def replace(self, **changes) -> "Step":
        check_names(changes, STEP_FIELDS, "step setting")
        return dataclasses.replace(self, **changes)

    @property
    def qlora_recipe(self) -> str:
        """``qlora_prepare`` resolved: "auto" is "none" with loop "sft" or weight sharding, else "peft"."""
        if self.qlora_prepare != "auto":
            return self.qlora_prepare
        return "none" if self.sharding in SHARDED_WEIGHTS or self.loop == "sft" else "peft"

    @property
    def kbit_prepared(self) -> bool:
        """QLoRA readied by peft's ``prepare_model_for_kbit_training`` (:attr:`qlora_recipe` "peft")."""
        return self.method == "qlora" and self.qlora_recipe == "peft"

    @property
    def half_dtype(self) -> str:
        """The 16-bit dtype the step computes in: ``dtype``, or bf16 for fp32 weights (autocast's,
        ``training.autocast_context``)."""
        return self.dtype if self.dtype != "float32" else "bfloat16"

    @property
    def activation_dtype(self) -> str:
        """The dtype a decoder layer's activations (its projections' outputs: q/k/v, the MLP's) are in: fp32 where
        QLoRA is readied by ``prepare_model_for_kbit_training`` (its fp32 norms feed every layer fp32), where
        ``dtype="float32"`` runs without autocast, and for QLoRA on fp32 weights even under autocast (bitsandbytes'
        ``Linear4bit`` returns its input's dtype, the fp32 stream); else the 16-bit dtype the matmuls compute in
        (bf16 under autocast of fp32 weights)."""
        if self.kbit_prepared or (self.dtype == "float32" and (not self.autocast or self.method == "qlora")):
            return "float32"
        return self.half_dtype

    @property
    def part_dtypes(self) -> dict:
        """The dtype each part runs in. QLoRA's usual recipe (prepare_model_for_kbit_training) up-casts every
        non-quantised tensor to fp32: activations, norms, lm_head; its 4-bit matmuls compute in ``dtype``, the
        compute dtype the kit gives bitsandbytes (``Linear4bit`` casts its input to it; its matmul is a custom operator
        autocast leaves alone, so fp32 weights compute in fp32 under autocast too). Without it
        (``qlora_prepare="none"``) everything but the 4-bit weights runs in ``dtype``, the adapters in bf16."""
        half, act = self.half_dtype, self.activation_dtype
        if self.method == "qlora" and not self.kbit_prepared:
            return {"base": self.dtype, "activations": act, "stream": self.dtype, "head": self.dtype,
                    "adapters": "bfloat16", "adapter_weights": "bfloat16", "weights": half}
        if self.method == "qlora":
            return {"base": self.dtype, "activations": act, "stream": "float32",
                    "head": half if self.autocast else "float32", "adapters": half if self.autocast else "float32",
                    "adapter_weights": "float32", "weights": half}
        base = half if self.autocast else self.dtype
        weights = "float32" if self.method == "full" and self.autocast else self.dtype  # autocast: fp32 master weights
        # the residual stream (embeddings, norms, residual adds) stays in the weights' dtype under autocast
        return {"base": base, "activations": act, "stream": weights, "head": base,
                "adapters": base if self.autocast else "float32", "adapter_weights": "float32", "weights": weights}

    def one_gpu(self) -> "Step":
        """This step on one GPU (what sharding is composed from), QLoRA still readied as it is here."""
        prepare = self.qlora_recipe if self.method == "qlora" else self.qlora_prepare
        return self.replace(sharding="none", num_gpus=1, cpu_offload=False, qlora_prepare=prepare)

    def for_method(self, method: str) -> "Step":
        """This step with another method; LoRA fields go back to their defaults for ``method="full"``."""
        lora = {k: getattr(PLANNING, k) for k in LORA_FIELDS} if method == "full" else {}
        return self.replace(method=method, **lora)


STEP_FIELD = {f.name: f for f in fields(Step)}
STEP_FIELDS = tuple(STEP_FIELD)
LORA_FIELDS = tuple(k for k, f in STEP_FIELD.items() if f.metadata["lora"])
CHOICES = {k: f.metadata["choices"] for k, f in STEP_FIELD.items() if f.metadata["choices"]}
AXIS_FIELDS = tuple(k for k, f in STEP_FIELD.items() if f.metadata["kind"] == "int")  # what a sweep may vary


def check_values(values: dict) -> dict:
    """The one validator of step values (scalars, or integer arrays for a sweep's axes): each field by its
    rule, then the rules between fields. Returns the normalised values."""
    out = {k: _check_field(STEP_FIELD[k], v) for k, v in values.items()}
    if out["method"] == "full":
        changed = [k for k in LORA_FIELDS if np.any(np.asarray(out[k] != getattr(PLANNING, k), dtype=bool))]
        if changed:
            raise ValueError(f"{', '.join(changed)} only appl{'y' if len(changed) > 1 else 'ies'} to method='lora' "
                             f"or 'qlora'; leave {'them' if len(changed) > 1 else 'it'} at the default with "
                             "method='full', or choose a LoRA method.")
    if out["sharding"] != "none" and np.any(np.asarray(out["num_gpus"]) < 2):
        raise ValueError(f"sharding={out['sharding']!r} needs num_gpus > 1; set num_gpus or use sharding='none'.")
    if out["cpu_offload"] and out["sharding"] not in SHARDED_STATES:
        raise ValueError("cpu_offload=True needs sharding='zero1', 'zero2', 'zero3' or 'fsdp'; set sharding, "
                         "or cpu_offload=False.")
    return out


def check_axes(step: "Step", **axes) -> dict:
    """A sweep: ``step`` plus the integer fields it varies (each a list or array of values), validated by the
    same rules as a Step. Returns the axes as int64 arrays."""
    check_names(axes, AXIS_FIELDS, "sweep axis")
    checked = check_values({**step.to_dict(), **{k: np.asarray(v) for k, v in axes.items()}})
    return {k: np.asarray(checked[k], dtype=np.int64) for k in axes}


def as_step(source=None, /, **overrides) -> Step:
    """The Step of ``source`` with ``overrides``: a Step, Settings (its step fields), a dict of step fields
    (other keys ignored, e.g. a record's "model"), or None for :data:`PLANNING`'s defaults."""
    if source is None:
        base = PLANNING
    elif isinstance(source, Step):
        base = source
    elif isinstance(source, dict):
        base = Step(**{k: v for k, v in source.items() if k in STEP_FIELD})
    else:
        base = source.step
    return base.replace(**overrides) if overrides else base


PLANNING = Step()  # planning a real model on a rented GPU: the Step defaults
# The embedded tiny model's journey on a CPU: each difference from PLANNING with its reason.
EMBEDDED_CHANGES = {
    "dtype": ("float32", "the tiny model trains on a CPU, where float32 is the exact, fast path (CPUs without "
                         "AVX512-BF16 emulate bfloat16 matmuls)"),
    "seq_len": (64, "the embedded tasks' rows are at most 64 tokens"),
    "batch_size": (16, "a 3M-parameter model learns the tutorial task in minutes only with many rows per step"),
    "gradient_checkpointing": (False, "its activations are a few MB; recomputing them would only cost time"),
    "padding": ("max_length", "the smoke run pads each batch of the user's rows to seq_len (so every step has the "
                              "planned shape), and the figures must describe those padded, masked batches"),
}
EMBEDDED = PLANNING.replace(**{k: v for k, (v, _) in EMBEDDED_CHANGES.items()})


@dataclass
class RunFields:
    """The settings of a run besides its step (declarations; :class:`Settings` holds them with the step's)."""
    # --- model ---------------------------------------------------------------------------
    model: str = setting("tiny", "catalog name, local directory, hub id, or \"tiny\" (the embedded default)")
    trust_remote_code: bool = setting(False, "run model code from the hub; off unless you trust the repo")
    # --- adapter -------------------------------------------------------------------------
    learning_rate: float = setting(2e-3, "peak learning rate")
    # --- planning ------------------------------------------------------------------------
    plan_model: str = setting("", "model the planning notebooks size GPUs for; empty: the model you train (the "
                              f"embedded tiny model, which fits any GPU, plans {EMBEDDED_PLAN_MODEL} and says so)")
    from_config: str = setting("", "a training config to plan from (TRL SFT / axolotl / LLaMA-Factory YAML, torchtune "
                               "recipe, TrainingArguments JSON): its model and step replace plan_model's and the "
                               "step's in notebooks 01/02; empty: none")
    gpu: str = setting("A100-80GB", "GPU the plan targets (see lora_kit.plan.gpus.gpu_table())")
    gpus: list = setting(None, "GPUs to compare", factory=lambda: ["T4", "L4", "A10G", "RTX-4090", "L40S",
                                                                     "A100-80GB", "H100-SXM"])
    margin: float = setting(0.10, "safety margin: a plan \"fits\" when it uses at most (1 - margin) of the GPU")
    # --- data ----------------------------------------------------------------------------
    dataset: str = setting("tiny:dates", "\"tiny:dates\" (embedded), or a JSONL / CSV file / datasets folder")
    prompt_field: str = setting("prompt", "dataset column holding the prompt")
    response_field: str = setting("response", "dataset column holding the reference answer")
    data_format: str = setting("auto", "\"auto\" | \"prompt_response\" | \"alpaca\" (instruction/input/output) | "
                               "\"messages\" (role/content lists)")
    messages_field: str = setting("messages", "dataset column holding the conversation when data_format is "
                                  "\"messages\"")
    dataset_split: str = setting("", "split of a datasets DatasetDict folder that trains (empty: \"train\", or the "
                                 "folder's only split)")
    train_on: str = setting("assistant", "conversation tokens trained: \"assistant\" (every assistant turn, as TRL's "
                            "assistant_only_loss=True and LLaMA-Factory) | \"last\" (the last assistant turn) | "
                            "\"all\" (every token, TRL 1.16's default)")
    prompt_format: str = setting("auto", "\"auto\" | \"plain\" (prompt, newline, \"Answer: \") | \"chat\" (the "
                                 "tokenizer's chat template) | a template with {prompt}")
    long_examples: str = setting("truncate", "examples longer than seq_len: \"truncate\" | \"drop\" | \"error\"")
    heldout_data_format: str = setting("auto", "format of heldout_dataset (\"auto\": detected on its own file)")
    control_data_format: str = setting("auto", "format of control_dataset (\"auto\": detected on its own file)")
    heldout_dataset: str = setting("", "held-out file/folder for evaluation (empty: the embedded test split, or "
                                   "heldout_fraction of dataset)")
    heldout_fraction: float = setting(0.1, "share of dataset held out (split by seed) when heldout_dataset is empty "
                                      "and dataset is your own")
    control_dataset: str = setting("auto", "prompts the fine-tune is not about (\"auto\": tiny:control for tiny, the "
                                   "shipped generic:control otherwise)")
    base_mix: float = setting(0.0, "share of control-task examples mixed into training (limits forgetting)")
    compare_base_mix: float = setting(0.25, "notebook 03 also trains an adapter with this share of base-task rows; "
                                      "04 compares it with the main one (0 skips)")
    # --- smoke run and evaluation --------------------------------------------------------
    max_steps: int = setting(300, "optimizer steps in the smoke run (the tutorial trains its adapter here)")
    seed: int = setting(0, "seed set before the adapter is created and before data shuffling")
    eval_examples: int = setting(200, "held-out examples to evaluate (0 means all)")
    control_examples: int = setting(200, "control examples to evaluate (0 means all)")
    max_new_tokens: int = setting(16, "generation budget, same for base and adapter")
    think: str = setting("answer", "a reasoning template's <think>...</think> block in generated answers: \"answer\" "
                         "judges the text after it (the evaluation summary says so) | \"whole\" judges everything")
    # --- output --------------------------------------------------------------------------
    run_dir: str = setting("runs/default", "where results, adapter, notebooks and the run card are written")
    interactive: bool = setting(True, "show ipywidgets panels (headless papermill runs set this to false)")


class _SettingsMethods:
    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Settings":
        return from_dict({**self.to_dict(), **changes})

    @property
    def step(self) -> Step:
        """The training step these settings run (and plan, for ``model``)."""
        return Step(**{k: getattr(self, k) for k in STEP_FIELDS})

    def plan_step(self) -> Step:
        """The step the planning notebooks size GPUs for: this run's step, except that a field left at its
        embedded CPU default (:data:`EMBEDDED_CHANGES`) takes the planning default (:data:`PLANNING`): the plan is
        a real GPU run of the planned model, with what the user set."""
        mine = self.step.to_dict()
        return Step(**{k: getattr(PLANNING, k) if k in EMBEDDED_CHANGES and v == EMBEDDED_CHANGES[k][0] else v
                       for k, v in mine.items()})

    def planning_model(self) -> str:
        """The model the planning notebooks size GPUs for: ``plan_model`` when named ("same" means ``model``),
        else the model being trained -- except the embedded tiny model, for which the tutorial plans
        :data:`EMBEDDED_PLAN_MODEL` (the tiny model fits any GPU)."""
        if self.plan_model and self.plan_model != "same":
            return self.plan_model
        return EMBEDDED_PLAN_MODEL if not self.plan_model and self.model in TINY_ALIASES else self.model

    def tutorial_plan(self) -> bool:
        """True for the embedded tutorial's planning: the embedded model with nothing else planned (no
        ``plan_model``, no ``from_config``). Notebook 01 states the tutorial's planning claims, and runs the kit's
        own check against the QLoRA paper, there only: neither is about a model of the user's."""
        return self.model in TINY_ALIASES and not self.plan_model and not self.from_config


def _settings_fields() -> list:
    """``model``, the step fields with the EMBEDDED defaults, then the other run fields (one order everywhere)."""
    run = {f.name: f for f in fields(RunFields)}

    def spec(f, default=dataclasses.MISSING):
        kw = {"metadata": f.metadata}
        if f.default_factory is not dataclasses.MISSING:
            kw["default_factory"] = f.default_factory
        else:
            kw["default"] = f.default if default is dataclasses.MISSING else default
        return (f.name, f.type, field(**kw))
    embedded = EMBEDDED.to_dict()
    step = [spec(f, embedded[f.name] if f.name != "lora_targets" else f.default) for f in fields(Step)]
    return [spec(run["model"]), *step, *(spec(f) for name, f in run.items() if name != "model")]


Settings = dataclasses.make_dataclass("Settings", _settings_fields(), bases=(_SettingsMethods,))
Settings.__module__ = __name__  # pickling and reprs name this module
Settings.__doc__ = ("A run's settings: ``model``, the :class:`Step` fields with the :data:`EMBEDDED` defaults, and "
                    "the run's other fields (:class:`RunFields`). Notebook parameters cells, params files and the "
                    "CLI flags are these names; ``Settings.doc(name)`` documents each.")
SETTINGS_FIELD = {f.name: f for f in fields(Settings)}
EMBEDDED_DEFAULTS = {k: SETTINGS_FIELD[k].default for k in STEP_FIELDS}


def field_help() -> dict[str, str]:
    """Field name -> its documentation (CLI help, docs)."""
    return {k: f.metadata["doc"] for k, f in SETTINGS_FIELD.items()}


def field_names() -> list[str]:
    return list(SETTINGS_FIELD)


def default_of(name: str):
    f = SETTINGS_FIELD[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def validate(s) -> None:
    """Raise ValueError naming the field to change. Cheap checks only (no model loading); the step fields
    are checked by making the :class:`Step` (the one validator)."""
    for k, v in s.step.to_dict().items():
        setattr(s, k, v)
    for name in ("max_steps", "max_new_tokens"):
        setattr(s, name, _check_int(name, getattr(s, name), 1, 1 << 24))
    for name in ("eval_examples", "control_examples"):
        setattr(s, name, check_count(name, getattr(s, name)))
    s.seed = _check_int("seed", s.seed, 0, (1 << 32) - 1)
    for name in ("trust_remote_code", "interactive"):
        setattr(s, name, parse_bool(name, getattr(s, name)))
    lr = s.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not 0 < lr < 1:
        raise ValueError(f"learning_rate must be a number in (0, 1), e.g. 2e-4; got {lr!r}.")
    if not 0 <= s.margin < 1:
        raise ValueError(f"margin must be in [0, 1), e.g. 0.10 for a 10 % safety margin; got {s.margin!r}.")
    for name in ("base_mix", "compare_base_mix"):
        if not 0 <= getattr(s, name) < 1:
            raise ValueError(f"{name} must be in [0, 1), e.g. 0.25 for a quarter of base-task rows; "
                             f"got {getattr(s, name)!r}.")
    for name, choices in (("data_format", DATA_FORMATS), ("heldout_data_format", DATA_FORMATS),
                          ("control_data_format", DATA_FORMATS), ("long_examples", LONG_EXAMPLES),
                          ("train_on", TRAIN_ON), ("think", THINK)):
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
    for name in ("heldout_dataset", "plan_model", "from_config", "dataset_split"):
        if not isinstance(getattr(s, name), str):
            raise ValueError(f"{name} must be a string ('' for the default), got {getattr(s, name)!r}.")


def coerce_value(name: str, value: Any) -> Any:
    """Coerce a string (CLI ``-p key value``) to the type of the field's default."""
    default = default_of(name)
    if not isinstance(value, str) or isinstance(default, str) and name != "lora_targets":
        return value
    if isinstance(default, bool):
        return parse_bool(name, value)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return type(default)(value) if isinstance(default, float) else int(value)
        except ValueError:
            kind = type(default).__name__
            raise ValueError(f"{name} expects {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {value!r}.") from None
    if name == "lora_targets":
        return _check_targets(value)
    if isinstance(default, list):
        import ast
        try:
            v = ast.literal_eval(value)
            return list(v) if isinstance(v, (list, tuple)) else [v]
        except (ValueError, SyntaxError):  # "L4,H200", or a list written without quotes: "[L4, H200]"
            inner = value.strip()
            inner = inner[1:-1] if inner[:1] + inner[-1:] in ("[]", "()") else inner
            return [t.strip().strip("'\"") for t in inner.split(",") if t.strip().strip("'\"")]
    return value


def from_dict(d: dict) -> "Settings":
    """Build Settings from a dict; unknown keys raise with "did you mean" and the list of valid ones."""
    check_names(d, field_names())
    clean = {}
    for k, v in d.items():
        v = coerce_value(k, v)
        t = default_of(k)
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
    if isinstance(loaded.get("run"), dict):  # the run identity lora_kit.results stamps on a run's settings.json
        loaded = {k: v for k, v in loaded.items() if k != "run"}
    return loaded


def load_settings(params_file: str | Path | None = None, overrides: dict | None = None) -> Settings:
    """Settings from a YAML params file plus ``overrides`` (later wins), validated."""
    d: dict = read_params(params_file) if params_file is not None else {}
    d.update(overrides or {})
    return from_dict(d)
