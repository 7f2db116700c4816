"""Loading models and tokenizers the safe way, for every part of the kit.

- ``model="tiny"`` (or :data:`lora_kit.DEFAULT_MODEL`) resolves to the embedded model shipped
  inside the package; a local directory is used as is; anything else is treated as a hub id
  (needs network access and, for gated models, the user's own login -- never stored by the kit).
  A path that does not exist is reported as such; a hub id is checked with one request before
  anything loads, so ``HF_HUB_OFFLINE=1`` without a cached copy, or an unreachable hub, fails at
  once with what to do (huggingface_hub would otherwise retry for ~25 s).
- Weights are loaded with safetensors only (``use_safetensors=True``): pickled ``.bin`` weights are
  refused, never unpickled. ``trust_remote_code`` stays off unless the caller sets it.
- QLoRA on CPU: bitsandbytes 0.50 on AVX512-BF16 CPUs repacks ``Linear4bit`` weights after any
  no-grad forward and later training forwards silently cut the gradient to the layer input.
  :func:`fix_bnb_cpu_repack` turns that path off on every 4-bit layer; :func:`load_model` always
  applies it (it is a no-op on CUDA).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lora_kit.model_catalog import hub_id
from lora_kit.settings import TINY_ALIASES  # noqa: F401 - the embedded model's names, used here
EMBEDDED_DIR = Path(__file__).parent / "embedded" / "tiny"
DTYPE_MAP = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(model: str | os.PathLike) -> str:
    """Path or hub id for ``model``; "tiny" -> the embedded model directory; a catalog name -> its hub id."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model in TINY_ALIASES:
        if not (EMBEDDED_DIR / "config.json").is_file():
            raise ValueError(f"The embedded model is missing at {EMBEDDED_DIR}; rebuild it with "
                             "`python scripts/build_tiny_model.py` or reinstall lora_kit.")
        return str(EMBEDDED_DIR)
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ValueError(f"{str(p)!r} has no config.json: pass a folder written by save_pretrained.")
        read_config_file(p / "config.json")  # a malformed file is named here, before any work
        return str(p)
    if looks_like_path(model):
        raise ValueError(f"model folder {model!r} does not exist (looked at {str(p.resolve())!r}); set model to a "
                         "folder written by save_pretrained, a hub id such as 'Qwen/Qwen2.5-0.5B', or 'tiny'.")
    if "/" not in model and hub_id(model):  # a catalog name plans offline; its weights are the hub model it names
        model = hub_id(model)
    check_hub(model)
    return model


def read_config_file(path: Path) -> dict:
    """A model's ``config.json`` as a dict; ValueError naming the file when it cannot be read or is not a JSON
    object."""
    try:
        c = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}); fix the file "
                         "or set model to another folder.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} cannot be read ({getattr(e, 'strerror', None) or e}); set model to a folder "
                         "holding a readable config.json.") from None
    if not isinstance(c, dict):
        raise ValueError(f"{str(path)!r} holds JSON but not an object of config fields; fix the file or set model to "
                         "another folder.")
    return c


def looks_like_path(model: str) -> bool:
    """True for what can only be a local path (a hub id is ``name`` or ``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1 or model.endswith("/"):
        return True
    try:
        validate_repo_id(model)
    except HFValidationError:
        return True
    return False


_HUB_OK: set[str] = set()  # hub ids already found reachable in this process (one request per id)


def _download_hint(repo_id: str) -> str:
    return (f"download it where the hub is reachable, with your own login for gated models (`hf auth login`, then "
            f"`hf download {repo_id} --local-dir models/{repo_id.split('/')[-1]}`), and set model to that folder")


def check_hub(repo_id: str, timeout: float = 5.0) -> None:
    """Fail at once, saying what to do, when ``repo_id`` cannot be loaded from the hub or its cache.

    Offline (``HF_HUB_OFFLINE=1``): passes only if the cache holds the model's config.json. Online:
    one request without retries (huggingface_hub's own downloads retry for ~25 s on a dead network);
    any HTTP answer counts as reachable (a missing or gated repo is reported by transformers itself).
    """
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    if repo_id in _HUB_OK:
        return
    here = f"{repo_id!r} is not a local folder (none at {str(Path(repo_id).resolve())!r})"
    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise ValueError(f"{here} and HF_HUB_OFFLINE=1 with no cached copy of it: {_download_hint(repo_id)}, "
                         "or unset HF_HUB_OFFLINE.")
    try:
        model_info(repo_id, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - network errors come from the HTTP client huggingface_hub uses
        if getattr(e, "response", None) is not None:  # the hub answered (404, 401, gated): reachable
            _HUB_OK.add(repo_id)
            return
        again = " A copy is in your cache: set HF_HUB_OFFLINE=1 to use it." if cached else ""
        raise ValueError(f"{here} and the hub ({constants.ENDPOINT}) is unreachable ({type(e).__name__}: "
                         f"{str(e)[:200]}): {_download_hint(repo_id)}.{again}") from None
    _HUB_OK.add(repo_id)


def check_weights(path: str) -> None:
    """Refuse a local model folder without safetensors weights (clear message, nothing unpickled)."""
    p = Path(path)
    if not p.is_dir():
        return
    if not any(p.glob("*.safetensors")):
        other = sorted(x.name for x in p.iterdir() if x.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (f" It has {other}: convert them to safetensors first (the kit never unpickles weights)."
                if other else "")
        raise ValueError(f"model folder {str(p)!r} holds no *.safetensors weights.{hint}")


def load_tokenizer(model: str, trust_remote_code: bool = False, padding_side: str = "left"):
    """Tokenizer with a pad token (EOS is reused if the tokenizer has none) and explicit padding side."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model(model), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token; set tokenizer.pad_token.")
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def bnb_config(dtype: str = "float32", double_quant: bool = True, storage_in_dtype: bool = False):
    """NF4 as the kit trains it; ``storage_in_dtype``: the packed 4-bit values stored as ``dtype`` elements (same
    bytes), which FSDP and ZeRO-3 need to shard them (sharded QLoRA: ``Step.qlora_prepare`` resolved to "none")."""
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=DTYPE_MAP[dtype],
                              bnb_4bit_quant_storage=DTYPE_MAP[dtype] if storage_in_dtype else torch.uint8)


def fix_bnb_cpu_repack(model) -> int:
    """Disable bitsandbytes' AVX512-BF16 CPU repacking on every Linear4bit; returns layers fixed."""
    n = 0
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def load_model(model: str, method: str = "lora", dtype: str = "float32", double_quant: bool = True,
               attn_implementation: str = "sdpa", trust_remote_code: bool = False, device: str | None = None,
               storage_in_dtype: bool = False):
    """Base model for ``method`` ("full" / "lora": weights in ``dtype``; "qlora": NF4 4-bit, stored as
    :func:`bnb_config` says)."""
    from transformers import AutoModelForCausalLM
    path = resolve_model(model)
    check_weights(path)
    kwargs = dict(dtype=DTYPE_MAP[dtype], attn_implementation=attn_implementation,
                  trust_remote_code=trust_remote_code, use_safetensors=True)
    if method == "qlora":
        kwargs["quantization_config"] = bnb_config(dtype, double_quant, storage_in_dtype)
        if device is not None:
            kwargs["device_map"] = {"": device}
    m = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if method != "qlora" and device is not None:
        m = m.to(device)
    fix_bnb_cpu_repack(m)
    return m
