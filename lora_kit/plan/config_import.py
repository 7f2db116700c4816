"""Plan from the training config you already have: TRL SFT, axolotl, LLaMA-Factory, torchtune, HF Trainer.

:func:`settings_from_config` reads one config file and returns the :class:`~lora_kit.settings.Step` its tool
will run, plus a :class:`ConfigReport`: where each step field came from, what the config sets that changes
memory or time but the plan does not model (``not_modelled``, never dropped in silence), and what does not matter
for the plan (``ignored``). The format is detected by content (:func:`detect_format`):

- **TRL SFT** (``trl sft --config``: ``SFTConfig``, ``ModelConfig`` and ``ScriptArguments`` fields in one YAML or
  JSON) -- parsed by TRL's own parser (the ``TrlParser`` ``trl sft`` builds), so what TRL rejects is rejected here
  with TRL's message, and every field the config leaves out takes TRL's default (``max_length`` 1024,
  ``per_device_train_batch_size`` 8, checkpointing on, ``ModelConfig.dtype`` float32 ...). Loop ``"sft"``.
- **HF TrainingArguments JSON** (``TrainingArguments.to_json_string()``) -- parsed by transformers'
  ``HfArgumentParser``; it holds no model, adapter or sequence length: those come from ``overrides``. Loop
  ``"trainer"``.
- **axolotl YAML** and **LLaMA-Factory YAML** -- read by the field names of their documented schemas (neither
  package installs beside this kit's transformers/TRL: both pin older versions); the checks their tools make on
  the fields read here are made here. Loop ``"trainer"`` (both train with a ``transformers.Trainer``).
- **torchtune recipe YAML** -- the model builder (``model._component_``), ``tokenizer.max_seq_len``, the
  optimizer component, ``dtype``, activation checkpointing. Loop ``"kit"`` (torchtune's loop is a plain step).

Attention and rows, as each tool batches them: FlashAttention-2 (TRL's ``attn_implementation``, axolotl's
``flash_attention``, LLaMA-Factory's ``flash_attn: fa2``) is the Step's ``attn_implementation="flash_attention_2"``;
padding-free packed rows (TRL's ``padding_free``, which its default ``packing`` strategy turns on; axolotl's
``sample_packing`` and LLaMA-Factory's ``neat_packing`` with FlashAttention-2) are ``padding="packed"`` at
``seq_len`` = the tool's row length and ``batch_size`` = its rows per micro-batch (the same tokens per micro-step).
A padded batch under FlashAttention-2 is planned as the padding the tool uses (transformers' unpad path: the real
tokens' q/k/v gathered for varlen FlashAttention-2); packed rows are planned with FlashAttention-2 only, under another
kernel as the tool's unpacked rows (listed, naming the key that plans them packed).

The planning machine is not the rented GPU: the parsers' checks of the local hardware (bf16 support, a GPU for
fp16, DeepSpeed installed) are kept out of the parse -- ``use_cpu``, ``deepspeed`` and ``tf32`` are read
apart. GPU count is never in these files (the launcher sets it): it comes from ``overrides`` (``num_gpus``);
a DeepSpeed / FSDP config on one GPU shards nothing and is planned unsharded, and the report says so.

Precision, as the tools run it: ``bf16`` / ``fp16`` turn on autocast over the loaded weights. For full
fine-tuning, autocast on weights already in 16 bits changes nothing, so it is planned as pure 16-bit training
(the Step's ``autocast=True`` means fp32 master weights); LLaMA-Factory up-casts trainable weights to fp32 unless
``pure_bf16``, which is fp32 master weights with autocast. The time model (``lora_kit/plan/timing.py``) runs
fp32 matmuls on CUDA cores (``time_constants.FP32_TFLOPS``), as PyTorch does with TF32 off, its default for
matmuls; ``tf32`` on with fp32 compute (TF32 tensor cores, faster than that) is not modelled.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lora_kit.settings import LORA_FIELDS, PLANNING, STEP_FIELDS, check_names

FORMATS = ("trl", "axolotl", "llamafactory", "torchtune", "trainer")
FORMAT_NAMES = {"trl": "TRL SFT config", "axolotl": "axolotl config", "llamafactory": "LLaMA-Factory config",
                "torchtune": "torchtune recipe config", "trainer": "HF TrainingArguments JSON"}
LOOP_OF = {"trl": "sft", "trainer": "trainer", "axolotl": "trainer", "llamafactory": "trainer", "torchtune": "kit"}

# transformers' ``optim`` names (TrainingArguments, SFTConfig, axolotl, LLaMA-Factory) -> the Step's optimizer
TRAINER_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                      "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
                      "paged_adamw_32bit": "paged_adamw_32bit", "paged_adamw": "paged_adamw_32bit", "sgd": "sgd",
                      "adafactor": "adafactor"}
# torchtune's optimizer components -> the Step's optimizer
TORCHTUNE_OPTIMIZERS = {"torch.optim.AdamW": "adamw", "torch.optim.SGD": "sgd",
                        "bitsandbytes.optim.AdamW8bit": "adamw_8bit", "bitsandbytes.optim.PagedAdamW8bit":
                        "paged_adamw_8bit", "bitsandbytes.optim.PagedAdamW": "paged_adamw_32bit",
                        "bitsandbytes.optim.PagedAdamW32bit": "paged_adamw_32bit"}
# torchtune's module names -> transformers' (Llama-style models)
TORCHTUNE_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj",
                     "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# torchtune model-builder families -> the catalog's spelling
TORCHTUNE_FAMILIES = {"llama3_3": "llama-3.3", "llama3_2": "llama-3.2", "llama3_1": "llama-3.1", "llama3": "llama-3",
                      "llama2": "llama-2", "qwen2_5": "qwen2.5", "qwen3": "qwen3", "gemma2": "gemma-2",
                      "gemma": "gemma", "mistral": "mistral", "phi3": "phi-3", "phi4": "phi-4"}
DTYPE_WORDS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
               "fp32": "float32", "float32": "float32", "float": "float32"}
FA2 = "flash_attention_2"


@dataclass
class ConfigReport:
    """What :func:`settings_from_config` read. ``mapped``: step field -> the config value it came from
    ("(<tool> default)" when the config left it to its tool); ``defaults``: step fields the config does not
    set, at the planning default; ``not_modelled``: ``{"key", "value", "why"}`` for each field or value that
    changes memory or time but is not in the plan; ``ignored``: config keys that do not change the plan."""
    path: str
    format: str
    model: str | None
    model_in_config: str | None = None
    mapped: dict = field(default_factory=dict)
    defaults: list = field(default_factory=list)
    not_modelled: list = field(default_factory=list)
    ignored: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """The report in lines, for the CLI and notebooks."""
        lines = [f"{FORMAT_NAMES[self.format]} {self.path}: model {self.model}"
                 + (f" (config: {self.model_in_config})" if self.model_in_config not in (None, self.model) else "")]
        lines += [f"  {k:<24}<- {v}" for k, v in self.mapped.items()]
        if self.defaults:
            lines.append(f"  planning defaults (not in the config): {', '.join(self.defaults)}")
        for n in self.not_modelled:
            lines.append(f"  NOT MODELLED {n['key']}={n['value']!r}: {n['why']}")
        if self.ignored:
            lines.append(f"  ignored (not read by the plan): {', '.join(self.ignored)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_SAME = object()  # "the config's value is the step's value"


class _Reader:
    """Collects a config's step values, their sources, what is not modelled and what was used."""

    def __init__(self, cfg: dict, fmt: str, path: Path):
        self.cfg, self.fmt, self.path = cfg, fmt, path
        self.vals: dict = {}
        self.src: dict = {}
        self.nm: list = []
        self.notes: list = []
        self.used: set = set()
        self.known: set = set()  # every key the reader looked for (a typo is near one of them)
        self.tool_unknown: set = set()  # keys the tool's own parser named as unknown (with their hints)
        self.over: dict = {}  # the caller's step values (win over the config)
        self.attn_key = "attn_implementation"  # the config key that set the attention kernel
        self.fa2_how = "attn_implementation=flash_attention_2"  # how this tool's config asks for FlashAttention-2
        self.packed: dict = {}  # packed rows (_packed): their key; fallback padding and why without FA2; caveat

    def has(self, key: str) -> bool:
        self.known.add(key.split(".")[0])
        return key in self.cfg and self.cfg[key] is not None

    def get(self, key: str, default=None):
        self.known.add(key.split(".")[0])
        self.used.add(key.split(".")[0])
        return self.cfg.get(key, default) if self.cfg.get(key) is not None else default

    def flag(self, key: str, default: bool = False, allow: tuple = ()):
        """A true/false setting as the tools read it (YAML booleans, 0 / 1, or "true" / "false" / "yes" / "no"
        written as strings, which pydantic and HfArgumentParser take as booleans), or one of ``allow`` (e.g.
        axolotl's "auto"); anything else is refused naming the key (Python's ``bool("false")`` is True)."""
        v = self.get(key, default)
        if isinstance(v, bool) or v in allow:
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        word = v.strip().lower() if isinstance(v, str) else None
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
        extra = "".join(f", {a!r}" for a in allow)
        raise ValueError(f"{self.path}: {key}={v!r} is not true or false{extra}; write {key}: true or {key}: false.")

    def put(self, name: str, value, key: str, raw=_SAME, default: bool = False) -> None:
        self.vals[name] = value
        shown = value if raw is _SAME else raw
        self.src[name] = f"{key}={shown!r}" + (f" ({self.fmt} default)" if default else "")
        self.used.add(key.split(".")[0].split("=")[0].split(" ")[0])

    def not_modelled(self, key: str, value, why: str) -> None:
        self.nm.append({"key": key, "value": value, "why": why})
        self.used.add(key.split(".")[0])


# ---------------------------------------------------------------------------------------------------------------
# detection and reading

def _load(path: Path) -> dict:
    import yaml
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist.")
    text = path.read_text(encoding="utf-8")
    try:
        cfg = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"config file {str(path)!r} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                         f"{str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of setting: value.")
    return cfg


TRL_ONLY = ("use_peft", "max_length", "packing", "padding_free", "dataset_text_field", "completion_only_loss",
            "assistant_only_loss", "dataset_name", "lora_target_modules", "load_in_4bit", "model_init_kwargs")
AXOLOTL_KEYS = ("base_model", "micro_batch_size", "sequence_len", "adapter", "lora_target_linear",
                "sample_packing", "pad_to_sequence_len", "flash_attention", "datasets")
LLAMAFACTORY_KEYS = ("finetuning_type", "cutoff_len", "lora_target", "quantization_bit", "template", "stage",
                     "flash_attn", "pure_bf16", "dataset_dir")


def detect_format(cfg: dict) -> str:
    """Which tool a config (a mapping) is for, by its content: torchtune's ``_component_`` builders, axolotl's
    ``base_model``, LLaMA-Factory's ``finetuning_type`` / ``cutoff_len`` / ``stage``, TRL's ``model_name_or_path``
    with SFT fields, or a bare ``TrainingArguments`` dump (``output_dir`` and trainer fields, no model)."""
    if any(isinstance(cfg.get(k), dict) and "_component_" in cfg[k] for k in ("model", "optimizer", "tokenizer")):
        return "torchtune"
    scores = {"axolotl": sum(k in cfg for k in AXOLOTL_KEYS),
              "llamafactory": sum(k in cfg for k in LLAMAFACTORY_KEYS)}
    if "base_model" in cfg:
        scores["axolotl"] += 3
    if "model_name_or_path" in cfg:
        scores["trl"] = 1 + sum(k in cfg for k in TRL_ONLY)
    best = max(scores, key=scores.get)
    if scores[best] > 0 and not (best == "trl" and scores.get("llamafactory", 0) >= scores["trl"]):
        return best
    if "output_dir" in cfg and "per_device_train_batch_size" in cfg:
        return "trainer"
    raise ValueError("cannot tell which tool this config is for: expected a TRL SFT config (model_name_or_path, "
                     "SFTConfig fields), an axolotl config (base_model), a LLaMA-Factory config (finetuning_type, "
                     "cutoff_len), a torchtune recipe config (model: _component_: ...) or a TrainingArguments "
                     "JSON (output_dir, per_device_train_batch_size).")


def settings_from_config(path, format: str | None = None, model: str | None = None, **overrides) -> tuple:
    """``(Step, ConfigReport)`` for the training config at ``path`` (TRL SFT, axolotl, LLaMA-Factory, torchtune
    or HF TrainingArguments JSON; ``format`` forces one of :data:`FORMATS`). ``model`` and ``overrides`` (step
    fields) win over the config -- a TrainingArguments JSON needs ``model`` and usually ``seq_len`` and
    ``method``; a multi-GPU job needs ``num_gpus``. The report's ``model`` is what to plan (a catalog name when
    the catalog knows the config's hub id, else the id or folder as given)."""
    from lora_kit.memory.specs import check_attention
    check_names(overrides, STEP_FIELDS, "step setting")
    path = Path(path).expanduser()
    cfg = _load(path)
    fmt = format or detect_format(cfg)
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not valid; choose one of {', '.join(FORMATS)}.")
    r = _Reader(cfg, fmt, path)
    r.over = overrides
    given_model = {"trl": _read_trl, "trainer": _read_trainer, "axolotl": _read_axolotl,
                   "llamafactory": _read_llamafactory, "torchtune": _read_torchtune}[fmt](r, model)
    r.put("loop", LOOP_OF[fmt], "format", raw=fmt)
    planned = model or (resolve_model(given_model, path.parent, r.notes) if given_model else None)
    if planned is None:
        raise ValueError(f"{path}: a {FORMAT_NAMES[fmt]} names no model; pass model= (--model): a catalog name, "
                         "a local folder holding config.json, or a hub id.")
    _finish_targets(r, planned)
    _finish_sharding(r, overrides)
    _finish_attention(r, overrides)
    vals = dict(r.vals)
    if vals.get("method", PLANNING.method) == "full" or overrides.get("method") == "full":
        for k in ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "double_quant"):
            if k in vals and k not in overrides:
                vals.pop(k)
                r.src.pop(k, None)
    for k, v in overrides.items():
        vals[k] = v
        r.src[k] = f"{v!r} (given)"
    try:
        step = PLANNING.replace(**vals)
        check_attention(step)  # the attention and rows the kit plans: what the caller gives is checked here
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    mapped = {k: r.src[k] for k in STEP_FIELDS if k in r.src}
    defaults = [k for k in STEP_FIELDS if k not in mapped and not (step.method == "full" and k in LORA_FIELDS)]
    ignored = sorted(k for k in cfg if k not in r.used and k not in {n["key"].split(".")[0] for n in r.nm})
    for k in ignored:  # a near miss of a key the kit reads is most likely a typo that changes the real run
        hint = "" if k in r.tool_unknown else typo_hint(k, r.known - set(cfg))
        if hint:
            r.notes.append(f"{k!r} is not a key the kit reads{hint}; the plan ignored it, and so may your tool")
    rep = ConfigReport(path=str(path), format=fmt, model=planned, model_in_config=given_model, mapped=mapped,
                       defaults=defaults, not_modelled=r.nm, ignored=ignored, notes=r.notes)
    return step, rep


# ---------------------------------------------------------------------------------------------------------------
# the model

def resolve_model(given: str, base_dir: Path | None = None, notes: list | None = None) -> str:
    """The model to plan for a config's model id: a local folder (as given, or beside the config) holding
    config.json; the catalog entry with that hub id or name; the catalog entry of the same architecture for an
    instruct / chat variant (``meta-llama/Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``); else the id as given
    (read from the hub when online), with a note saying what to do offline."""
    from lora_kit.memory.specs import catalog
    notes = notes if notes is not None else []
    given = str(given)
    for cand in (Path(given).expanduser(), (base_dir or Path.cwd()) / given):
        if (cand / "config.json").is_file():
            return str(cand)
    cat = catalog()
    key = given.lower().rstrip("/")
    for name, facts in cat.items():
        if key in (name, facts["hub_id"].lower()):
            return name
    stem = _variant_stem(key)
    for name, facts in cat.items():
        if stem in (_variant_stem(facts["hub_id"]), name):
            notes.append(f"model {given}: planned as the catalog's {name} ({facts['hub_id']}), the same architecture")
            return name
    notes.append(f"model {given} is not in the catalog: its config.json is read from the hub when online; offline, "
                 "pass a local folder holding its config.json as the model (--model PATH)")
    return given


_VARIANT_WORDS = {"instruct", "it", "chat", "hf", "base"}


def _variant_stem(hub_id: str) -> str:
    """A repo name without the words that name a tuned or packaged variant of the same architecture ("Instruct",
    "it", "chat", "hf", "Base", wherever they stand) nor "Meta-": Mistral-7B-Instruct-v0.3 and Mistral-7B-v0.3 are
    one stem, v0.2 another (its vocabulary differs)."""
    repo = hub_id.lower().rstrip("/").split("/")[-1]
    return re.sub(r"^meta-", "", "-".join(w for w in repo.split("-") if w not in _VARIANT_WORDS))


def _peft_default_targets(model: str) -> list | None:
    """peft's default LoRA targets for ``model``'s architecture (what ``LoraConfig(target_modules=None)`` adapts)."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        from lora_kit.memory.specs import model_spec
        return DEFAULTS.get(model_spec(model).model_type)
    except (ImportError, ValueError):
        return None


def _finish_targets(r: _Reader, model: str) -> None:
    if r.vals.get("lora_targets") == "peft-default":
        default = _peft_default_targets(model)
        if default:
            r.vals["lora_targets"] = tuple(default)
            r.src["lora_targets"] = r.src["lora_targets"] + f" -> peft's default for this architecture {default}"
        else:
            r.vals.pop("lora_targets")
            r.not_modelled("lora_target_modules", None, "peft's default targets for this architecture are unknown "
                           "here; planned with 'all-linear' (pass lora_targets to plan others)")


def _finish_sharding(r: _Reader, overrides: dict) -> None:
    """A sharded config on one GPU shards nothing: plan it unsharded (and its offload, which needs sharding)."""
    gpus = overrides.get("num_gpus", r.vals.get("num_gpus", 1))
    if gpus > 1 and r.vals.get("sharding", "none") == "none" and "sharding" not in overrides:
        r.put("sharding", "ddp", "num_gpus", raw=f"{gpus} GPUs, no DeepSpeed / FSDP: DDP replicas")
    if r.vals.get("sharding", "none") != "none" and gpus < 2 and "sharding" not in overrides:
        how = r.src.pop("sharding")
        r.vals.pop("sharding")
        r.notes.append(f"{how}: on one GPU nothing is sharded; planned unsharded. Pass num_gpus (--num-gpus N) "
                       "for the GPUs you will launch on")
        if r.vals.pop("cpu_offload", False):
            r.not_modelled(r.src.pop("cpu_offload").split("=")[0], True, "CPU offload of sharded states needs "
                           "num_gpus > 1 in the plan; pass --num-gpus N")
        r.src.pop("cpu_offload", None)


# ---------------------------------------------------------------------------------------------------------------
# shared mappings

def _trainer_optim(r: _Reader, key: str, value, default: bool = False) -> None:
    name = str(getattr(value, "value", value))
    if name in TRAINER_OPTIMIZERS:
        r.put("optimizer", TRAINER_OPTIMIZERS[name], key, raw=name, default=default)
    else:
        r.not_modelled(key, name, "this optimizer's states and step are not modelled; planned as AdamW (32-bit "
                       "states), the Trainer's default")


def _precision(r: _Reader, method: str, dtype: str, bf16: bool, fp16: bool, keys: str, upcast_full: bool = False):
    """dtype / autocast from the weights' dtype and the bf16 / fp16 flags, as the HF Trainer runs them. Full
    fine-tuning: fp32 weights (or LLaMA-Factory's fp32 up-cast, ``upcast_full``) under a 16-bit flag are the Step's
    ``autocast=True`` with ``dtype`` the compute dtype (fp32 master weights); 16-bit weights under a flag train in
    pure 16 bits (autocast changes nothing)."""
    mixed = bool(bf16) or bool(fp16)
    compute = "float16" if fp16 else "bfloat16"
    if method == "full" and mixed and dtype != "float32" and not upcast_full:
        autocast = False
        r.notes.append(f"{keys}: autocast over {dtype} weights changes nothing for full fine-tuning; planned as "
                       f"pure {dtype} training")
    elif method == "full" and mixed:
        autocast = True
        if dtype != compute:
            r.vals["dtype"] = compute
            r.src["dtype"] = r.src.get("dtype", f"dtype={dtype!r}") + f" -> fp32 master weights, {compute} compute"
    else:
        autocast = mixed
    r.put("autocast", autocast, keys, raw=f"bf16={bool(bf16)}, fp16={bool(fp16)}")


def _tf32(r: _Reader, key: str, value, step_dtype: str, autocast: bool) -> None:
    """``tf32: true`` with fp32 compute and no autocast is not modelled; ``false`` or unset (PyTorch's default for
    matmuls) is, and with bf16/fp16 compute TF32 does not touch the matmuls."""
    if value is None:
        return
    if value and step_dtype == "float32" and not autocast:
        r.not_modelled(key, value, "TF32 tensor cores run fp32 matmuls faster than the time model, which runs them "
                       "on CUDA cores as PyTorch does by default")
    else:
        r.used.add(key)


def _attention(r: _Reader, key: str, value, default: bool = False, fa2_how: str | None = None) -> None:
    """The attention kernel ``value`` names (``fa2_how``: how this tool's config asks for FlashAttention-2)."""
    v = str(value).lower() if value is not None else "sdpa"
    r.attn_key, r.fa2_how = key, fa2_how or f"{key}: {FA2}"
    if v in ("sdpa", "eager", FA2, "fa2"):
        r.put("attn_implementation", FA2 if v == "fa2" else v, key, raw=value, default=default)
    elif "flash" in v or re.fullmatch(r"fa\d", v):
        r.put("attn_implementation", FA2, key, raw=value)
        r.not_modelled(key, value, "this FlashAttention version is not modelled; planned with FlashAttention-2, "
                       "which transformers runs through the same (varlen) interface")
    else:
        r.not_modelled(key, value, "this attention kernel is not modelled; planned with SDPA")


def _packed(r: _Reader, key: str, raw, fallback: str, why_not: str, caveat: str | None = None,
            note: str | None = None) -> None:
    """Packed rows from config key ``key``: ``padding='packed'``; without FlashAttention-2, ``fallback`` and a
    not-modelled line (``why_not``: what the tool runs instead); with it, ``caveat`` listed as not modelled and
    ``note`` noted (when given)."""
    r.put("padding", "packed", key, raw=raw)
    r.packed = {"key": key, "fallback": fallback, "why_not": why_not, "caveat": caveat, "note": note}


def _finish_attention(r: _Reader, overrides: dict) -> None:
    """The attention and the rows as the kit plans them (``lora_kit.memory.specs.check_attention``): FlashAttention-2
    needs 16-bit q/k/v; packed rows need FlashAttention-2 (without it, the tool's fallback). A padded batch keeps
    its padding under any kernel. What the caller gives is left to the step's own check."""
    val = {k: overrides.get(k, r.vals.get(k, getattr(PLANNING, k)))
           for k in ("attn_implementation", "padding", "dtype", "autocast")}
    given = "attn_implementation" in overrides
    key = "attn_implementation" if given else r.attn_key  # where FlashAttention-2 was asked for, and how
    shown = FA2 if given else r.cfg.get(r.attn_key) or FA2
    if (val["attn_implementation"] == FA2 and val["dtype"] == "float32" and not val["autocast"]
            and not given):
        r.put("attn_implementation", "sdpa", key, raw=f"{shown} -> sdpa")
        r.not_modelled(key, shown, "flash-attn takes fp16 / bf16 q/k/v only and these weights are fp32 "
                       "without bf16 / fp16 autocast (the run stops in flash-attn); planned with sdpa; turn bf16 on")
        val["attn_implementation"] = "sdpa"
    fa2, pad = val["attn_implementation"] == FA2, val["padding"]
    if "padding" in overrides:
        return
    if pad == "packed" and r.packed:
        p = r.packed
        if fa2:
            if p["caveat"]:
                r.not_modelled(p["key"], True, p["caveat"])
            if p["note"]:
                r.notes.append(p["note"])
        else:
            fallback, why = p["fallback"], p["why_not"]
            r.vals["padding"] = fallback
            r.src["padding"] = r.src["padding"] + f" -> {fallback!r} without FlashAttention-2"
            r.not_modelled(p["key"], True, f"{why}, not modelled: the kit plans packed rows with "
                           f"FlashAttention-2 only; planned as rows of seq_len, padding={fallback!r}; set {r.fa2_how} "
                           "to plan them packed")


def _deepspeed(r: _Reader, key: str, value) -> None:
    """The ZeRO stage and offload of a DeepSpeed config (a dict, or a JSON file beside the config or here)."""
    ds = value
    if isinstance(value, str):
        for cand in (r.path.parent / value, Path(value).expanduser()):
            if cand.is_file():
                ds = json.loads(cand.read_text())
                break
        else:
            m = re.search(r"(?:zero|stage|z)[_-]?([0-3])(?![0-9])", Path(value).name.lower())
            if not m:
                r.not_modelled(key, value, "DeepSpeed config file not found here and its name gives no ZeRO stage; "
                               "planned unsharded")
                return
            ds = {"zero_optimization": {"stage": int(m.group(1))}}
            r.notes.append(f"{key}: {value} not found here; ZeRO stage {m.group(1)} read from its name")
    zero = (ds or {}).get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0) or 0)
    if stage == 0:
        r.put("sharding", "ddp", key, raw=value)
        return
    r.put("sharding", f"zero{stage}", key, raw=value)
    off = [k for k in ("offload_optimizer", "offload_param")
           if str((zero.get(k) or {}).get("device", "none")).lower() in ("cpu", "nvme")]
    if off:
        r.put("cpu_offload", True, f"{key}.zero_optimization.{off[0]}", raw="cpu")


def _fsdp_one(r: _Reader, key: str, version) -> None:
    """A note where the config runs FSDP-1: the kit plans (and runs) FSDP2."""
    if str(version).strip() == "1":
        r.notes.append(f"{key}=1: FSDP-1, planned as FSDP2 (fully_shard, what the kit runs); an FSDP-1 job reserves "
                       "more than this plan (it keeps the unsharded model's blocks cached from loading: the published "
                       "FSDP-1 rows in docs/accuracy.md)")


def _fsdp(r: _Reader, key: str, value, fsdp_config: dict | None = None) -> None:
    """TrainingArguments' ``fsdp``: a string or list of options, or (transformers 5) True with the options in
    ``fsdp_config`` (``cpu_offload``, ``reshard_after_forward``)."""
    if value is True:
        fc = fsdp_config or {}
        value = ["full_shard" if fc.get("reshard_after_forward", True) else "shard_grad_op"]
        value += ["offload"] if fc.get("cpu_offload") or fc.get("offload_params") else []
    opts = value.split() if isinstance(value, str) else [str(getattr(o, "value", o)) for o in (value or [])]
    if not opts or opts == [""]:
        return
    if "full_shard" in opts or "hybrid_shard" in opts:
        r.put("sharding", "fsdp", key, raw=" ".join(opts))
        _fsdp_one(r, "fsdp_config.version", (fsdp_config or {}).get("version"))
    elif "shard_grad_op" in opts:
        r.put("sharding", "zero2", key, raw=" ".join(opts))
        r.notes.append(f"{key}: FSDP shard_grad_op (ZeRO-2 semantics) planned as zero2")
    else:
        r.not_modelled(key, " ".join(opts), "this FSDP mode is not modelled; planned unsharded")
        return
    if "offload" in opts:
        r.put("cpu_offload", True, key, raw=" ".join(opts))


def _targets_list(value) -> Any:
    if isinstance(value, str):
        value = [t.strip() for t in value.split(",") if t.strip()]
    return tuple(value)


# ---------------------------------------------------------------------------------------------------------------
# TRL SFT and HF TrainingArguments: the tools' own parsers

def _hardware_free(cfg: dict) -> tuple[dict, dict]:
    """The config without the keys whose parse checks the local hardware (read apart), and those keys."""
    d = dict(cfg)
    apart = {k: d.pop(k) for k in ("deepspeed", "tf32", "use_cpu", "env") if k in d}
    d["use_cpu"] = True  # the parse must not probe this machine's GPU: the plan is for the rented one
    return d, apart


def _one_edit(a: str, b: str) -> bool:
    """``a`` and ``b`` differ by one typing slip: a letter dropped, added or changed, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def _spelled_out(key: str, known: str) -> bool:
    """``key`` writes out a known key's abbreviated last word: ``sequence_length`` for ``sequence_len``,
    ``cutoff_length`` for ``cutoff_len`` (the known key a prefix, at most 3 letters added to its last word)."""
    return key.startswith(known) and 0 < len(key) - len(known) <= 3 and "_" in known and "_" not in key[len(known):]


def typo_hint(key: str, known) -> str:
    """" (did you mean 'x'?)" when ``key`` is one slip from exactly one of ``known`` keys, or writes out its
    abbreviated last word (:func:`_spelled_out`), else "". Stricter than the settings' hint: a tool's config holds
    many real keys the kit does not read (``use_rslora`` is not a typo of ``use_dora``)."""
    close = sorted({k for k in known if _one_edit(key, k) or _spelled_out(key, k)})
    return f" (did you mean {close[0]!r}?)" if len(close) == 1 else ""


def _parse_trl(r: _Reader):
    from trl.scripts.sft import make_parser
    d, apart = _hardware_free(r.cfg)
    d.setdefault("output_dir", "trl-output")
    parser = make_parser()
    try:
        unknown = parser.set_defaults_with_config(**d)
        script, args, margs, *_ = parser.parse_args_into_dataclasses(args=[], return_remaining_strings=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{r.path}: trl sft rejects this config: {e}") from None
    known = sorted({a.dest for a in parser._actions})
    if unknown:
        keys = [str(u)[2:] for u in unknown if str(u).startswith("--")] or [str(u) for u in unknown]
        r.tool_unknown |= set(keys)
        named = ", ".join(f"{k!r}{typo_hint(k, known)}" for k in keys)
        r.notes.append(f"trl sft does not know {named} (it ignores {'them' if len(keys) != 1 else 'it'})")
    return args, margs, apart


def _read_trl(r: _Reader, model_override) -> str | None:
    args, m, apart = _parse_trl(r)
    given = r.has
    mik = dict(args.model_init_kwargs or {})
    lora = bool(m.use_peft)
    if m.load_in_4bit and not lora:
        raise ValueError(f"{r.path}: load_in_4bit without use_peft: transformers cannot train a 4-bit model "
                         "without adapters; set use_peft: true (QLoRA) or drop load_in_4bit.")
    method = "qlora" if lora and m.load_in_4bit else "lora" if lora else "full"
    r.put("method", method, "use_peft/load_in_4bit", raw=f"use_peft={lora}, load_in_4bit={bool(m.load_in_4bit)}",
          default=not (given("use_peft") or given("load_in_4bit")))
    r.used |= {"use_peft", "load_in_4bit"}
    if m.load_in_8bit:
        r.not_modelled("load_in_8bit", True, "8-bit base weights are not modelled; planned as a 16-bit LoRA base")
    dtype_raw = mik.get("dtype", mik.get("torch_dtype", m.dtype))
    dkey = "model_init_kwargs.dtype" if ("dtype" in mik or "torch_dtype" in mik) else "dtype"
    dtype = DTYPE_WORDS.get(str(dtype_raw).replace("torch.", ""), None)
    if dtype is None:  # "auto": the checkpoint's dtype
        dtype = "bfloat16"
        r.notes.append(f"{dkey}={dtype_raw!r}: the checkpoint's dtype, planned as bfloat16 (that of current models)")
    r.put("dtype", dtype, dkey, raw=dtype_raw, default=not (given("dtype") or "dtype" in mik))
    if lora:
        r.put("lora_rank", int(m.lora_r), "lora_r", default=not given("lora_r"))
        r.put("lora_alpha", int(m.lora_alpha), "lora_alpha", default=not given("lora_alpha"))
        r.put("lora_dropout", float(m.lora_dropout), "lora_dropout", default=not given("lora_dropout"))
        t = m.lora_target_modules
        if t is None:
            r.put("lora_targets", "peft-default", "lora_target_modules", raw=None, default=True)
        else:
            t = t if isinstance(t, (list, tuple)) else [t]
            r.put("lora_targets", "all-linear" if list(t) == ["all-linear"] else _targets_list(t),
                  "lora_target_modules", raw=t)
        if method == "qlora":
            r.put("double_quant", bool(m.use_bnb_nested_quant), "use_bnb_nested_quant",
                  default=not given("use_bnb_nested_quant"))
        for key, why in (("use_dora", "DoRA keeps a magnitude vector and a weight-norm per layer"),
                         ("lora_modules_to_save", "modules trained in full beside the adapters"),
                         ("lora_target_parameters", "LoRA on parameters (MoE experts) is not modelled")):
            if getattr(m, key):
                r.not_modelled(key, getattr(m, key), why + "; not in the plan")
        if m.bnb_4bit_quant_storage and method == "qlora":  # packed values take the same bytes in any storage
            r.used.add("bnb_4bit_quant_storage")
            r.notes.append(f"bnb_4bit_quant_storage={m.bnb_4bit_quant_storage!r}: the same bytes as uint8 storage; "
                           "with sharding 'fsdp' / 'zero3' the 4-bit weights are planned sharded")
    r.put("seq_len", int(args.max_length) if args.max_length else PLANNING.seq_len, "max_length",
          default=not given("max_length"))
    if not args.max_length:
        r.not_modelled("max_length", None, "rows are not truncated: the longest row sets the peak; planned at "
                       f"{PLANNING.seq_len} tokens (pass seq_len)")
    r.put("batch_size", int(args.per_device_train_batch_size), "per_device_train_batch_size",
          default=not given("per_device_train_batch_size"))
    r.put("grad_accum", int(args.gradient_accumulation_steps), "gradient_accumulation_steps",
          default=not given("gradient_accumulation_steps"))
    _trainer_common(r, args, method, dtype, given)
    # trl sft builds model_init_kwargs from ModelConfig, the config's model_init_kwargs winning (scripts/sft.py:76)
    _attention(r, "model_init_kwargs.attn_implementation" if "attn_implementation" in mik else "attn_implementation",
               mik.get("attn_implementation", m.attn_implementation),
               default=not (given("attn_implementation") or "attn_implementation" in mik),
               fa2_how="attn_implementation: flash_attention_2")
    r.used.add("model_init_kwargs")
    _trl_rows(r, args)
    if getattr(args, "activation_offloading", False):
        r.not_modelled("activation_offloading", True, "activations offloaded to the CPU are not modelled")
    r.used.add("activation_offloading")
    _tf32(r, "tf32", apart.get("tf32"), r.vals["dtype"], r.vals["autocast"])
    if apart.get("deepspeed"):
        _deepspeed(r, "deepspeed", apart["deepspeed"])
    r.used |= {"model_name_or_path"}
    return m.model_name_or_path  # the config's own model: the report shows it beside a --model override


def _trl_rows(r: _Reader, args) -> None:
    """How TRL 1.16's SFTTrainer batches rows. Packing with 'bfd' / 'bfd_split' (the default strategy) turns
    padding_free on (trl/trainer/sft_trainer.py:916): the batch's packs, each up to max_length tokens, flattened into
    one row with position_ids restarting per example and no mask -- the step's ``padding='packed'`` at
    seq_len=max_length, batch_size=per_device_train_batch_size (the same tokens per micro-step). Otherwise the
    collator pads to the batch's longest row with a mask (to a multiple of ``pad_to_multiple_of`` when set)."""
    free = bool(args.padding_free) or bool(args.packing) and args.packing_strategy in ("bfd", "bfd_split")
    r.used |= {"packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "eval_packing"}
    if args.packing and not args.max_length:  # sft_trainer.py:1468
        raise ValueError(f"{r.path}: packing without max_length: TRL's SFTTrainer refuses it (\"When packing is "
                         "enabled, `max_length` can't be `None`\"); set max_length.")
    if free and not args.packing and args.max_length:  # sft_trainer.py:999
        raise ValueError(f"{r.path}: padding_free without packing and max_length={args.max_length}: TRL's "
                         "SFTTrainer refuses it (\"When `padding_free=True` without packing, `max_length` is not "
                         "enforced\"); set packing: true, or max_length: null.")
    if free:
        key = "packing" if args.packing else "padding_free"
        raw = (f"packing=True, packing_strategy={args.packing_strategy!r}: padding_free" if args.packing
               else "padding_free=True")
        _packed(r, key, raw, "none", "TRL flattens each batch into one row (sft_trainer.py:916) that transformers "
                "masks block-diagonally for sdpa / eager (a tokens x tokens mask from position_ids)",
                note="packing: each of the batch's rows is a pack of examples up to max_length tokens; the plan "
                "counts one example per pack (more, shorter examples attend over fewer tokens and add 128 spare "
                "fp32 rows each to one layer's FlashAttention-2 backward buffers)" if args.packing else None)
        if args.pad_to_multiple_of:
            r.not_modelled("pad_to_multiple_of", args.pad_to_multiple_of, "the flattened row is padded up to a "
                           "multiple of it: pad tokens beyond the plan's rows")
    elif args.packing:  # 'wrapped': rows cut at exactly max_length, attended across examples
        r.put("padding", "none", "packing_strategy", raw="wrapped: rows of exactly max_length, nothing padded")
    elif args.pad_to_multiple_of and args.max_length and int(args.pad_to_multiple_of) == int(args.max_length):
        r.put("padding", "max_length", "pad_to_multiple_of", raw=args.pad_to_multiple_of)
    else:
        r.put("padding", "longest", "padding", raw="the SFT collator pads to the longest row", default=True)


# axolotl's LigerPlugin (axolotl.integrations.liger) applies the kernels whose flag is set; the Trainer's
# use_liger_kernel=True applies these four (liger-kernel's apply_liger_kernel_to_<type> defaults)
AXOLOTL_LIGER_DEFAULTS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")


def _axolotl_liger(r: _Reader, c: dict) -> None:
    """axolotl's Liger plugin and its ``liger_*`` flags: ``liger_kernel`` when the plugin applies the Trainer's
    default kernels, else listed as not modelled (planned without Liger)."""
    plugin = [p for p in (c.get("plugins") or []) if "liger" in str(p).lower()]
    flags = {k: c[k] for k in c if k.startswith("liger_") and c[k]}
    r.used |= {k for k in c if k.startswith("liger_")}
    if plugin and set(flags) == set(AXOLOTL_LIGER_DEFAULTS):
        r.put("liger_kernel", True, "plugins", raw=f"{plugin[0]} with {', '.join(AXOLOTL_LIGER_DEFAULTS)}")
    elif plugin or flags:
        r.not_modelled("plugins" if plugin else next(iter(flags)), plugin + sorted(flags),
                       f"Liger is modelled with the plugin and exactly {', '.join(AXOLOTL_LIGER_DEFAULTS)} on (the "
                       "Trainer's use_liger_kernel kernels); planned without Liger")


def _trainer_common(r: _Reader, args, method: str, dtype: str, given) -> None:
    """What SFTConfig shares with TrainingArguments: checkpointing, optimizer, precision, FSDP, Liger, compile."""
    ckpt_key = "activation_checkpointing" if given("activation_checkpointing") else "gradient_checkpointing"
    ckpt = bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)
    r.put("gradient_checkpointing", ckpt, ckpt_key, default=not (given("gradient_checkpointing")
                                                                 or given("activation_checkpointing")))
    r.used |= {"gradient_checkpointing", "activation_checkpointing"}
    kw = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    if ckpt and kw.get("use_reentrant"):
        r.not_modelled("gradient_checkpointing_kwargs.use_reentrant", True, "reentrant checkpointing is not "
                       "modelled; planned as the non-reentrant kind")
    r.used |= {"gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"}
    _trainer_optim(r, "optim", args.optim, default=not given("optim"))
    bf16 = bool(args.bf16)
    _precision(r, method, dtype, bf16, args.fp16, "bf16/fp16")
    r.used |= {"bf16", "fp16"}
    if args.fsdp:
        _fsdp(r, "fsdp", args.fsdp, args.fsdp_config)
    r.used |= {"fsdp", "fsdp_config"}
    r.put("liger_kernel", bool(args.use_liger_kernel), "use_liger_kernel", default=not given("use_liger_kernel"))
    if args.use_liger_kernel and args.liger_kernel_config:
        r.not_modelled("liger_kernel_config", args.liger_kernel_config, "Liger is planned with its defaults (rope, "
                       "rms_norm, swiglu, fused_linear_cross_entropy; TRL's SFTTrainer without the last)")
    if args.torch_compile:
        r.not_modelled("torch_compile", True, "torch.compile changes which activations are kept; not modelled")
    r.used |= {"use_liger_kernel", "liger_kernel_config", "torch_compile"}


def _read_trainer(r: _Reader, model_override) -> str | None:
    from transformers import HfArgumentParser, TrainingArguments
    d, apart = _hardware_free(r.cfg)
    try:
        (args,) = HfArgumentParser(TrainingArguments).parse_dict(d, allow_extra_keys=False)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{r.path}: transformers' TrainingArguments rejects this config: {e}") from None
    given = r.has
    import dataclasses
    same = {f.name for f in dataclasses.fields(TrainingArguments)
            if f.default is not dataclasses.MISSING and r.cfg.get(f.name, f.default) == f.default}
    r.used |= same  # a dump holds every field: those at their defaults are not listed as ignored
    r.put("batch_size", int(args.per_device_train_batch_size), "per_device_train_batch_size")
    r.put("grad_accum", int(args.gradient_accumulation_steps), "gradient_accumulation_steps")
    r.notes.append("a TrainingArguments JSON holds no model, adapter or sequence length: model, method, dtype, "
                   "seq_len and the LoRA fields are the planning defaults unless given (--model, --method, ...)")
    method, dtype = r.over.get("method", PLANNING.method), r.over.get("dtype", PLANNING.dtype)
    _trainer_common(r, args, method, dtype, given)
    r.put("padding", "longest", "padding", raw="the Trainer's padding collator pads to the longest row", default=True)
    _tf32(r, "tf32", apart.get("tf32"), r.vals.get("dtype", dtype), r.vals["autocast"])
    if apart.get("deepspeed"):
        _deepspeed(r, "deepspeed", apart["deepspeed"])
    return None  # TrainingArguments name no model: model= (--model) gives it


# ---------------------------------------------------------------------------------------------------------------
# axolotl

AXOLOTL_OPTIM_EXTRA = {"adamw_bnb_8bit": "adamw_8bit"}  # axolotl's spellings beyond transformers'


def bf16_auto_note() -> str:
    """What axolotl's ``bf16: auto`` is, by the kit's one rule of which GPU has bf16
    (:func:`lora_kit.plan.gpus.has_bf16`, the one ``gpu_problems`` applies): bf16 where the GPU has it, else fp16."""
    from lora_kit.plan.gpus import BF16_FROM, has_bf16, known_gpus
    without = [g for g in known_gpus() if not has_bf16(g)]
    named = f" (the catalog's {', '.join(without)})" if without else ""
    return (f"bf16: auto -> bf16, what axolotl picks on a GPU with bf16 (compute capability {BF16_FROM:.1f}, Ampere, "
            f"and newer); on one without{named} it trains in fp16: plan that with dtype float16 (--dtype float16)")


def _read_axolotl(r: _Reader, model_override) -> str | None:
    c = r.cfg
    adapter = r.get("adapter")
    if adapter not in (None, "lora", "qlora"):
        raise ValueError(f"{r.path}: adapter={adapter!r}: axolotl takes 'lora', 'qlora' or none (full fine-tuning).")
    if c.get("load_in_4bit") and c.get("load_in_8bit"):
        raise ValueError(f"{r.path}: load_in_4bit and load_in_8bit are both set; axolotl takes one.")
    if adapter == "qlora" and not c.get("load_in_4bit"):
        raise ValueError(f"{r.path}: adapter: qlora needs load_in_4bit: true (axolotl's rule).")
    if c.get("bf16") is True and c.get("fp16") is True:
        raise ValueError(f"{r.path}: bf16 and fp16 are both true; axolotl takes one.")
    bits = "load_in_4bit" if c.get("load_in_4bit") else "load_in_8bit" if c.get("load_in_8bit") else None
    if adapter is None and bits:  # transformers' Trainer refuses to train a quantized model without adapters
        near = [k for k in c if _one_edit(k, "adapter")]
        raise ValueError(f"{r.path}: {bits} without adapter: transformers cannot train a quantized base in full; "
                         f"set adapter: {'qlora' if bits == 'load_in_4bit' else 'lora'}, or drop {bits} for full "
                         "fine-tuning." + (f" (the config has {near[0]!r}: did you mean 'adapter'?)" if near else ""))
    method = "full" if adapter is None else ("qlora" if c.get("load_in_4bit") else "lora")
    r.put("method", method, "adapter", raw=adapter)
    r.used |= {"load_in_4bit", "load_in_8bit"}
    if adapter == "lora" and c.get("load_in_4bit"):
        r.notes.append("adapter: lora with load_in_4bit: a 4-bit base, planned as QLoRA")
    if c.get("load_in_8bit"):
        r.not_modelled("load_in_8bit", True, "8-bit base weights are not modelled; planned as a 16-bit LoRA base")
    bf16 = r.flag("bf16", False, allow=("auto",))
    fp16 = r.flag("fp16")
    if bf16 == "auto":
        r.notes.append(bf16_auto_note())
    bf16 = bool(bf16)
    pure = "bfloat16" if r.flag("bfloat16") else "float16" if r.flag("float16") else None  # 16-bit weights, no AMP
    # axolotl loads the weights in the AMP dtype (bf16 / fp16), in the pure dtype, else in fp32
    dtype = "bfloat16" if bf16 else "float16" if fp16 else pure or "float32"
    r.put("dtype", dtype, "bf16/fp16/bfloat16/float16", raw=f"bf16={c.get('bf16')}, fp16={c.get('fp16')}, "
          f"bfloat16={c.get('bfloat16')}, float16={c.get('float16')}")
    _precision(r, method, dtype, bf16, fp16, "bf16/fp16")
    _tf32(r, "tf32", r.get("tf32"), dtype, r.vals["autocast"])
    if method != "full":
        r.put("lora_rank", int(r.get("lora_r", 8)), "lora_r", default=not r.has("lora_r"))
        r.put("lora_alpha", int(r.get("lora_alpha", 16)), "lora_alpha", default=not r.has("lora_alpha"))
        r.put("lora_dropout", float(r.get("lora_dropout", 0.0)), "lora_dropout", default=not r.has("lora_dropout"))
        if r.get("lora_target_linear"):
            r.put("lora_targets", "all-linear", "lora_target_linear", raw=True)
        elif r.get("lora_target_modules"):
            t = r.get("lora_target_modules")
            r.put("lora_targets", "all-linear" if t in ("all-linear", ["all-linear"]) else _targets_list(t),
                  "lora_target_modules", raw=t)
        else:
            r.put("lora_targets", "peft-default", "lora_target_modules", raw=None, default=True)
        if method == "qlora":
            dq = (r.get("bnb_config_kwargs") or {}).get("bnb_4bit_use_double_quant", True)
            r.put("double_quant", bool(dq), "bnb_config_kwargs.bnb_4bit_use_double_quant",
                  default="bnb_4bit_use_double_quant" not in (c.get("bnb_config_kwargs") or {}))
        for key, why in (("peft_use_dora", "DoRA keeps a magnitude vector and a weight-norm per layer"),
                         ("lora_modules_to_save", "modules trained in full beside the adapters")):
            if r.get(key):
                r.not_modelled(key, c[key], why + "; not in the plan")
    r.put("seq_len", int(r.get("sequence_len", 2048)), "sequence_len", default=not r.has("sequence_len"))
    r.put("batch_size", int(r.get("micro_batch_size", 1)), "micro_batch_size", default=not r.has("micro_batch_size"))
    r.put("grad_accum", int(r.get("gradient_accumulation_steps", 1)), "gradient_accumulation_steps",
          default=not r.has("gradient_accumulation_steps"))
    gc = r.flag("gradient_checkpointing", False, allow=("unsloth", "offload", "offload_disk"))
    if gc in ("unsloth", "offload", "offload_disk"):
        r.put("gradient_checkpointing", True, "gradient_checkpointing", raw=gc)
        r.not_modelled("gradient_checkpointing", gc, "checkpoints offloaded to the CPU are not modelled; planned "
                       "as checkpointing on the GPU")
    else:
        r.put("gradient_checkpointing", bool(gc), "gradient_checkpointing", default=not r.has("gradient_checkpointing"))
    if gc and (r.get("gradient_checkpointing_kwargs") or {}).get("use_reentrant"):
        r.not_modelled("gradient_checkpointing_kwargs.use_reentrant", True, "reentrant checkpointing is not "
                       "modelled; planned as the non-reentrant kind")
    opt = r.get("optimizer", "adamw_torch_fused")
    _trainer_optim(r, "optimizer", AXOLOTL_OPTIM_EXTRA.get(opt, opt), default=not r.has("optimizer"))
    attn = [k for k in ("flash_attention", "sdp_attention", "xformers_attention", "s2_attention",
                        "flex_attention", "eager_attention") if r.get(k)]
    if not attn:
        r.put("attn_implementation", "sdpa", "attention", raw="transformers' default", default=True)
    for k in attn:
        if k == "sdp_attention":
            r.put("attn_implementation", "sdpa", k, raw=True)
        elif k == "eager_attention":
            r.put("attn_implementation", "eager", k, raw=True)
        elif k == "flash_attention":
            r.put("attn_implementation", FA2, k, raw=True)
            r.attn_key = k
        else:
            r.not_modelled(k, True, "this attention kernel is not modelled; planned with SDPA")
    r.fa2_how = "flash_attention: true"
    pad = r.flag("pad_to_sequence_len")
    if r.get("sample_packing"):
        # axolotl's multipack: with flash_attention one row of micro_batch_size x sequence_len tokens, each example
        # marked in the mask for flash_attn_varlen_func; without it micro_batch_size rows (multipack_real_batches)
        _packed(r, "sample_packing", f"sample_packing=True, pad_to_sequence_len={pad}", "max_length",
                "without flash_attention axolotl packs micro_batch_size rows of sequence_len with a per-example "
                "attention mask", caveat="axolotl's multipack (assumed from its trainer: one row of micro_batch_size "
                "x sequence_len tokens, examples numbered in the attention mask that its patched _get_unpad_data "
                "turns into varlen cu_seqlens) gathers q/k/v into copies, not modelled; planned as padding='packed' "
                "(the same varlen FlashAttention-2 over the same tokens, q/k/v as views)")
    else:
        r.put("padding", "max_length" if pad else "longest", "pad_to_sequence_len", raw=pad,
              default=not r.has("pad_to_sequence_len"))
    _axolotl_liger(r, c)
    for key in ("unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o", "unsloth_cross_entropy_loss",
                "torch_compile", "cut_cross_entropy", "activation_offloading"):
        if r.get(key):
            r.not_modelled(key, c[key], "changes which activations are kept; not modelled")
    if r.get("deepspeed"):
        _deepspeed(r, "deepspeed", c["deepspeed"])
    if r.get("fsdp") or r.get("fsdp_config"):
        fc = r.get("fsdp_config") or {}
        r.put("sharding", "fsdp", "fsdp_config" if fc else "fsdp", raw=fc.get("fsdp_version", c.get("fsdp_version"))
              or c.get("fsdp"))
        r.used |= {"fsdp_version"}
        _fsdp_one(r, "fsdp_version", fc.get("fsdp_version", c.get("fsdp_version")))
        if fc.get("fsdp_offload_params") or fc.get("offload_params"):
            r.put("cpu_offload", True, "fsdp_config.fsdp_offload_params", raw=True)
    r.used |= {"base_model"}
    return c.get("base_model")


# ---------------------------------------------------------------------------------------------------------------
# LLaMA-Factory

def _read_llamafactory(r: _Reader, model_override) -> str | None:
    c = r.cfg
    ft = r.get("finetuning_type", "lora")
    if ft not in ("lora", "full", "freeze", "oft"):
        raise ValueError(f"{r.path}: finetuning_type={ft!r}: LLaMA-Factory takes lora, full, freeze or oft.")
    stage = r.get("stage", "sft")
    if stage not in ("sft", "pt"):
        r.not_modelled("stage", stage, "this stage keeps more than one step's model state (a reference or reward "
                       "model, pairs of rows); planned as one SFT step")
    qbit = r.get("quantization_bit")
    if qbit not in (None, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"{r.path}: quantization_bit={qbit!r} is not a bit width LLaMA-Factory takes.")
    qmethod = r.get("quantization_method", "bnb") or "bnb"
    if ft in ("freeze", "oft"):
        r.not_modelled("finetuning_type", ft, "freeze / OFT tuning is not modelled; planned as LoRA")
        ft = "lora"
    if qbit is not None and ft == "full":
        raise ValueError(f"{r.path}: quantization_bit with finetuning_type: full: LLaMA-Factory cannot train a "
                         "quantized model in full; use finetuning_type: lora (QLoRA).")
    method = "full" if ft == "full" else "qlora" if qbit == 4 and qmethod == "bnb" else "lora"
    r.put("method", method, "finetuning_type/quantization_bit", raw=f"{c.get('finetuning_type', 'lora')}, "
          f"quantization_bit={qbit}", default=not r.has("finetuning_type"))
    if qbit is not None and method != "qlora":
        r.not_modelled("quantization_bit", qbit, f"{qbit}-bit ({qmethod}) base weights are not modelled; planned as "
                       "a 16-bit LoRA base")
    bf16, fp16, pure = r.flag("bf16"), r.flag("fp16"), r.flag("pure_bf16")
    if bf16 and fp16:
        raise ValueError(f"{r.path}: bf16 and fp16 are both true; LLaMA-Factory takes one.")
    # LLaMA-Factory loads the weights in the compute dtype (bf16 / fp16; inferred, bf16 on Ampere+, if neither)
    # and up-casts trainable weights to fp32 unless pure_bf16
    dtype = "float16" if fp16 else "bfloat16"
    r.put("dtype", dtype, "bf16/fp16/pure_bf16", raw=f"bf16={bf16}, fp16={fp16}, pure_bf16={pure}")
    if method == "full" and not (bf16 or fp16 or pure):
        r.vals["dtype"] = "float32"
        r.notes.append("finetuning_type: full without bf16/fp16: trainable weights up-cast to fp32, no autocast: "
                       "planned as float32 training")
    _precision(r, method, r.vals["dtype"], bf16 and not pure, fp16, "bf16/fp16", upcast_full=not pure)
    _tf32(r, "tf32", r.get("tf32"), r.vals["dtype"], r.vals["autocast"])
    if method != "full":
        rank = int(r.get("lora_rank", 8))
        r.put("lora_rank", rank, "lora_rank", default=not r.has("lora_rank"))
        r.put("lora_alpha", int(r.get("lora_alpha") or 2 * rank), "lora_alpha", default=not r.has("lora_alpha"))
        r.put("lora_dropout", float(r.get("lora_dropout", 0.0)), "lora_dropout", default=not r.has("lora_dropout"))
        t = r.get("lora_target", "all")
        r.put("lora_targets", "all-linear" if t in ("all", ["all"]) else _targets_list(t), "lora_target", raw=t,
              default=not r.has("lora_target"))
        if method == "qlora":
            r.put("double_quant", r.flag("double_quantization", True), "double_quantization",
                  default=not r.has("double_quantization"))
        for key, why in (("use_dora", "DoRA keeps a magnitude vector and a weight-norm per layer"),
                         ("additional_target", "modules trained in full beside the adapters"),
                         ("pissa_init", "PiSSA initialisation runs an SVD per layer at load")):
            if r.get(key):
                r.not_modelled(key, c[key], why + "; not in the plan")
    r.put("seq_len", int(r.get("cutoff_len", 2048)), "cutoff_len", default=not r.has("cutoff_len"))
    r.put("batch_size", int(r.get("per_device_train_batch_size", 8)), "per_device_train_batch_size",
          default=not r.has("per_device_train_batch_size"))
    r.put("grad_accum", int(r.get("gradient_accumulation_steps", 1)), "gradient_accumulation_steps",
          default=not r.has("gradient_accumulation_steps"))
    off = r.flag("disable_gradient_checkpointing")
    r.put("gradient_checkpointing", not off, "disable_gradient_checkpointing", raw=off,
          default=not r.has("disable_gradient_checkpointing"))
    if not off and r.get("use_reentrant_gc", True):
        r.not_modelled("use_reentrant_gc", True, "LLaMA-Factory checkpoints reentrantly by default; planned as "
                       "the non-reentrant kind (set use_reentrant_gc: false to run what is planned)")
    _trainer_optim(r, "optim", r.get("optim", "adamw_torch"), default=not r.has("optim"))
    for key in ("use_galore", "use_badam", "use_apollo", "use_adam_mini", "use_muon"):
        if r.get(key):
            r.not_modelled(key, True, "this optimizer's states are not modelled; planned as AdamW")
    if r.get("enable_liger_kernel"):  # LLaMA-Factory's apply_liger_kernel: Liger's defaults for SFT
        r.put("liger_kernel", True, "enable_liger_kernel")
    fa = r.get("flash_attn", "auto")
    _attention(r, "flash_attn", {"auto": "sdpa", "disabled": "eager", "sdpa": "sdpa"}.get(fa, fa),
               default=not r.has("flash_attn"), fa2_how="flash_attn: fa2")
    if r.get("neat_packing"):  # packing without cross-attention between the packed examples (implies packing)
        _packed(r, "neat_packing", True, "max_length", "without flash_attn: fa2 LLaMA-Factory masks the packed rows "
                "with a 4D block-diagonal mask (rows x cutoff_len x cutoff_len)", caveat="LLaMA-Factory numbers the "
                "packed examples in the attention mask and unpads the rows for varlen FlashAttention-2 (its "
                "configure_packing patches _get_unpad_data): the gathered q/k/v copies are not modelled; planned as "
                "padding='packed' over the same per_device_train_batch_size x cutoff_len tokens")
    elif r.get("packing"):  # PackedSupervisedDatasetProcessor: every pack filled to the same length, mask all ones
        r.put("padding", "none", "packing", raw="examples packed into rows of exactly cutoff_len tokens, attended as "
              "one sequence (no neat_packing), pads masked as ones: no padding")
    else:
        r.put("padding", "longest", "padding", raw="LLaMA-Factory's collator pads to the longest row", default=True)
    r.used.add("packing")
    for key, why in (("use_unsloth", "unsloth's kernels are not modelled"),
                     ("use_unsloth_gc", "unsloth's offloaded checkpoints are not modelled"),
                     ("shift_attn", "shift short attention is not modelled"),
                     ("mixture_of_depths", "mixture-of-depths is not modelled"),
                     ("torch_compile", "torch.compile changes which activations are kept; not modelled")):
        if r.get(key):
            r.not_modelled(key, c[key], why)
    if r.get("deepspeed"):
        _deepspeed(r, "deepspeed", c["deepspeed"])
    if r.get("fsdp"):
        _fsdp(r, "fsdp", c["fsdp"])
        r.used.add("fsdp_config")
    r.used |= {"model_name_or_path", "quantization_method", "quantization_type", "upcast_layernorm"}
    return c.get("model_name_or_path")


# ---------------------------------------------------------------------------------------------------------------
# torchtune

def _torchtune_model(component: str) -> str | None:
    """``torchtune.models.llama3_1.lora_llama3_1_8b`` -> ``llama-3.1-8b`` (a catalog name), or None."""
    from lora_kit.memory.specs import catalog
    builder = component.rsplit(".", 1)[-1]
    builder = re.sub(r"^(q?lora)_", "", builder)
    builder = re.sub(r"_(instruct|base|it)$", "", builder)
    for fam, name in sorted(TORCHTUNE_FAMILIES.items(), key=lambda kv: -len(kv[0])):
        if builder.startswith(fam + "_"):
            size = builder[len(fam) + 1:].replace("_", ".")
            for cand in (f"{name}-{size}", f"{name}{size}"):
                if cand in catalog():
                    return cand
    return None


def _read_torchtune(r: _Reader, model_override) -> str | None:
    c = r.cfg
    mdl = c.get("model") or {}
    comp = str(mdl.get("_component_", ""))
    builder = comp.rsplit(".", 1)[-1]
    method = "qlora" if builder.startswith("qlora_") else "lora" if builder.startswith("lora_") else "full"
    r.put("method", method, "model._component_", raw=comp)
    if method == "qlora":
        r.put("double_quant", True, "model._component_", raw="torchao NF4 (scalers double-quantized)")
        r.not_modelled("model._component_", comp, "torchtune's QLoRA quantizes with torchao's NF4, not "
                       "bitsandbytes; planned with bitsandbytes' NF4 layout (the same 4 bits per weight)")
    dtype = DTYPE_WORDS.get(str(c.get("dtype", "bf16")), None)
    if dtype is None:
        raise ValueError(f"{r.path}: dtype={c.get('dtype')!r}: torchtune takes bf16 or fp32.")
    r.put("dtype", dtype, "dtype", raw=c.get("dtype", "bf16"), default="dtype" not in c)
    r.put("autocast", False, "dtype", raw=f"{c.get('dtype', 'bf16')} (torchtune trains in one dtype, no autocast)")
    if method != "full":
        r.put("lora_rank", int(mdl.get("lora_rank", 8)), "model.lora_rank")
        r.put("lora_alpha", int(mdl.get("lora_alpha", 16)), "model.lora_alpha")
        r.put("lora_dropout", float(mdl.get("lora_dropout", 0.0)), "model.lora_dropout",
              default="lora_dropout" not in mdl)
        attn = list(mdl.get("lora_attn_modules", ["q_proj", "v_proj"]))
        mlp = bool(mdl.get("apply_lora_to_mlp", False))
        names = [TORCHTUNE_MODULES.get(a, a) for a in attn] + (["gate_proj", "up_proj", "down_proj"] if mlp else [])
        full = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        r.put("lora_targets", "all-linear" if sorted(names) == sorted(full) else tuple(names),
              "model.lora_attn_modules/apply_lora_to_mlp", raw=f"{attn}, apply_lora_to_mlp={mlp}")
        if mdl.get("apply_lora_to_output"):
            r.not_modelled("model.apply_lora_to_output", True, "LoRA on the output projection (lm_head) is not in "
                           "the plan ('all-linear' leaves lm_head out)")
        if dtype != "float32":
            r.not_modelled("dtype", c.get("dtype", "bf16"), f"torchtune keeps the LoRA adapters in {dtype}; the plan "
                           "counts them in fp32, as peft does (a slight over-estimate)")
    tok = c.get("tokenizer") or {}
    msl = tok.get("max_seq_len")
    r.put("seq_len", int(msl) if msl else PLANNING.seq_len, "tokenizer.max_seq_len", raw=msl)
    if not msl:
        r.not_modelled("tokenizer.max_seq_len", msl, "rows are not truncated: the longest row sets the peak; "
                       f"planned at {PLANNING.seq_len} tokens (pass seq_len)")
    r.put("batch_size", int(c.get("batch_size", 1)), "batch_size", default="batch_size" not in c)
    r.put("grad_accum", int(c.get("gradient_accumulation_steps") or 1), "gradient_accumulation_steps",
          default="gradient_accumulation_steps" not in c)
    r.put("gradient_checkpointing", bool(c.get("enable_activation_checkpointing", False)),
          "enable_activation_checkpointing", default="enable_activation_checkpointing" not in c)
    opt = str((c.get("optimizer") or {}).get("_component_", "torch.optim.AdamW"))
    if opt in TORCHTUNE_OPTIMIZERS:
        r.put("optimizer", TORCHTUNE_OPTIMIZERS[opt], "optimizer._component_", raw=opt)
    else:
        r.not_modelled("optimizer._component_", opt, "this optimizer's states are not modelled; planned as AdamW")
    r.put("attn_implementation", "sdpa", "model", raw="torchtune's attention (SDPA)", default=True)
    r.put("padding", "none", "collate", raw="torchtune pads with the ignore index, no attention mask", default=True)
    loss = str((c.get("loss") or {}).get("_component_", ""))
    if "Chunked" in loss or "LinearCrossEntropy" in loss:
        r.not_modelled("loss._component_", loss, "a chunked / fused cross-entropy never materialises the whole "
                       "logits; the plan counts them whole (an over-estimate)")
    for key, why in (("enable_activation_offloading", "activations offloaded to the CPU are not modelled"),
                     ("optimizer_in_bwd", "optimizer steps fused into backward keep no whole gradients; not "
                      "modelled"),
                     ("compile", "torch.compile changes which activations are kept; not modelled")):
        if c.get(key):
            r.not_modelled(key, c[key], why)
    if (c.get("dataset") or {}).get("packed") if isinstance(c.get("dataset"), dict) else False:
        r.not_modelled("dataset.packed", True, "torchtune's packed rows attend through its own block-causal mask, "
                       "not modelled (the kit plans packed rows with transformers' FlashAttention-2 only); planned "
                       "as rows of max_seq_len with no mask")
    if c.get("fsdp_cpu_offload"):
        r.put("cpu_offload", True, "fsdp_cpu_offload")
    if "fsdp_cpu_offload" in c or "fsdp_sharding_strategy" in c:
        r.put("sharding", "fsdp", "fsdp_cpu_offload", raw="a distributed recipe shards with FSDP2")
    r.used |= {"model", "tokenizer", "batch_size", "gradient_accumulation_steps", "enable_activation_checkpointing",
               "optimizer", "dtype", "loss", "fsdp_sharding_strategy"}
    found = _torchtune_model(comp)
    if found:
        return found
    ckpt = (c.get("checkpointer") or {}).get("checkpoint_dir")
    r.used.add("checkpointer")
    if ckpt:
        if not model_override:
            r.notes.append(f"model builder {comp} is not in the catalog; planned from checkpointer.checkpoint_dir")
        return str(Path(ckpt).name) if not Path(ckpt).is_dir() else ckpt
    return None


def plan_start(settings, config=None) -> tuple:
    """(model, step, report) the planning notebooks and the planner panel start from: the training config
    ``config`` (a path; default: the settings' ``from_config`` field when it has one) read by
    :func:`settings_from_config`, else ``settings.planning_model()`` at ``settings.plan_step()`` (report None).
    The config's step fields win over the settings' step; flags are not applied here."""
    config = config if config is not None else settings.from_config
    if not config:
        return settings.planning_model(), settings.plan_step(), None
    step, report = settings_from_config(config)
    return report.model, step, report


# ---------------------------------------------------------------------------------------------------------------
# a smoke run of the config's job

def trl_config(path) -> dict:
    """The mapping of a TRL SFT config file, once TRL's own parser accepts it (``trl sft --config``: its message
    otherwise); ValueError when the file is another tool's config."""
    path = Path(path).expanduser()
    cfg = _load(path)
    fmt = detect_format(cfg)
    if fmt != "trl":
        raise ValueError(f"{path} is a {FORMAT_NAMES[fmt]}, not a TRL SFT config: the smoke run runs TRL's "
                         "SFTTrainer from a TRL SFT config only (loop='sft'); plan it with lora-kit estimate "
                         "--from-config, or clear from_config.")
    _parse_trl(_Reader(cfg, "trl", path))
    return cfg


def run_settings(path, **overrides):
    """``(Settings, ConfigReport)`` for a smoke run of the job a TRL SFT config describes: the step
    :func:`settings_from_config` maps (loop ``"sft"``), the model as the config names it (a local folder or hub id:
    the run loads it), its ``learning_rate``, ``seed`` and ``from_config``
    set to ``path`` -- so the smoke run's SFTTrainer also takes the config's other trainer fields (scheduler, warm-up,
    weight decay, clipping ...). ``overrides`` (any Settings field: ``dataset``, ``max_steps``, ``run_dir`` ...) win."""
    from lora_kit.settings import field_names, from_dict
    path = Path(path).expanduser()
    trl_config(path)
    check_names(overrides, field_names(), "setting")
    step_over = {k: v for k, v in overrides.items() if k in STEP_FIELDS}
    model = overrides.get("model")
    step, report = settings_from_config(path, format="trl", model=model, **step_over)
    args, _, _ = _parse_trl(_Reader(_load(path), "trl", path))
    run = {"model": model or report.model_in_config, "learning_rate": float(args.learning_rate), "seed": int(args.seed),
           "from_config": str(path)}
    return from_dict({**step.to_dict(), **run, **overrides}), report
