"""Model specs: the architecture facts the memory estimator needs, read from a transformers config.

``model_spec(model)`` accepts

- a catalog name from ``lora_kit/catalog/models.json`` (``"llama-3.1-8b"``; the hub id of a catalog
  entry works too) -- offline, no download;
- ``"tiny"`` -- the embedded model shipped with the package;
- a local directory holding ``config.json``, or the path of a ``config.json`` file;
- a ``transformers.PretrainedConfig``;
- a hub id (only when online: ``HF_HUB_OFFLINE`` unset; ``trust_remote_code`` stays off).

Trade-offs: known families (llama, mistral, qwen2, gemma / gemma2, phi3, gpt_neox) are described in
closed form, so a spec costs a dict lookup and no torch import. Any other causal-LM architecture is
built once on the meta device (no memory, ~0.1-1 s, torch import) and its layers read from the module
tree; the activation model then assumes a Llama-like block and is less exact. Specs are cached.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from lora_kit.model_catalog import catalog_file


GATED_MLP_TYPES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "phi3", "qwen3", "olmo2", "granite")
KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox")


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder block (LoRA target candidate)."""
    name: str
    in_features: int
    out_features: int
    bias: bool
    kind: str  # "attn_in" (q/k/v or fused qkv), "attn_out", "mlp_in", "mlp_out"
    layers: int = 0  # blocks that hold this layer; 0 = every block (DeepSeek: the dense MLP of block 0 only)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a decoder-only causal LM (one block described, ``num_layers`` of them)."""
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    gated_mlp: bool  # SwiGLU/GeGLU (gate, up, down) vs plain (up, down)
    linears: tuple  # tuple[Linear, ...] of one block
    norms_per_layer: int  # normalisation layers per block
    norm_bias: bool  # LayerNorm with bias (gpt_neox) vs RMSNorm
    parallel_residual: bool = False  # gpt_neox: attention and MLP read the same input
    qk_norms: bool = False  # qwen3, gemma3, olmo2: an RMSNorm on q and on k in every block
    post_mlp_norm: bool = False  # gemma2/3, olmo2: a norm on the MLP's output (it saves down_proj's output)
    rotary_fraction: float = 1.0  # gpt_neox (partial_rotary_factor): the share of each head rotary turns
    norm_upcast: bool = False  # gemma*, olmo2: RMSNorm multiplies by its weight in fp32, then casts ((x * w).to(dtype))
    rotary_fp32: bool = False  # olmo2: cos and sin stay fp32, so q and k turn in fp32 and are cast back
    attn_softcap: bool = False  # gemma2: tanh soft-capping of attention scores (eager only)
    final_softcap: bool = False  # gemma2: tanh soft-capping of the logits
    embed_scale: bool = False  # gemma: embeddings multiplied by sqrt(hidden)
    exact: bool = True  # False: layers read from a meta-device build, activations assume Llama-like
    extra_params: tuple = ()  # (numel, count) of tensors outside the scheme above (generic; qwen3 q/k norms)
    config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def param_tensors(self) -> list[tuple[str, int, int]]:
        """(group, numel, count) for every parameter tensor; groups: embed, lm_head, linear, bias, norm.

        Used for exact byte counts (each storage is rounded up to 512 bytes) and to know which
        tensors QLoRA quantizes (``linear`` only).
        """
        h, n = self.hidden_size, self.num_layers
        out = [("embed", self.vocab_size * h, 1)]
        if not self.tied_embeddings:
            out.append(("lm_head", self.vocab_size * h, 1))
        for lin in self.linears:
            out.append(("linear", lin.in_features * lin.out_features, lin.layers or n))
            if lin.bias:
                out.append(("bias", lin.out_features, lin.layers or n))
        if self.exact:  # generic specs carry every non-linear tensor in extra_params
            out.append(("norm", h, (self.norms_per_layer * n + 1) * (2 if self.norm_bias else 1)))
        out.extend(("norm", numel, count) for numel, count in self.extra_params)
        return out

    @property
    def num_params(self) -> int:
        return sum(numel * count for _, numel, count in self.param_tensors())

    @property
    def moe(self) -> dict:
        """Mixture-of-experts facts of the config (:func:`moe_facts`); empty for a dense model."""
        return moe_facts(self.config)


CATALOG_META = ("hub_id", "params")  # catalog fields that are not config.json fields


def catalog() -> dict[str, dict]:
    """Catalog name -> config facts (offline), as shipped in ``lora_kit/catalog/models.json``.

    Each entry holds the architecture fields of the model's published ``config.json`` plus ``hub_id``
    and ``params`` (the exact parameter count, equal to the model built on the meta device);
    :func:`catalog_source` says where each entry's numbers were read. Mixture-of-experts entries are the
    ones with a non-empty :func:`moe_facts`."""
    return catalog_file()["models"]


def catalog_config(name: str) -> dict:
    """The config.json fields of catalog entry ``name`` (what ``AutoConfig.for_model`` takes)."""
    return {k: v for k, v in catalog()[name].items() if k not in CATALOG_META}


def catalog_source(name: str) -> dict:
    """Where catalog entry ``name`` was read: ``config`` (the hub config.json), ``read`` (the copies and
    tables the numbers were taken from, with commit or URL), ``published_params`` where a model card or
    paper states a count, and a ``note`` on anything not literally in the config. Entries that predate the
    sources section have none ({})."""
    return catalog_file().get("sources", {}).get(name, {})


MOE_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def moe_facts(c: dict) -> dict:
    """Mixture-of-experts fields of a config dict under their family names (Mixtral ``num_local_experts``,
    Qwen-MoE ``num_experts`` / ``decoder_sparse_step`` / ``mlp_only_layers`` / shared expert, DeepSeek
    ``n_routed_experts`` / ``n_shared_experts`` / ``first_k_dense_replace`` / ``moe_layer_freq``), as
    ``experts``, ``experts_per_token``, ``expert_intermediate_size``, ``shared_experts`` (count),
    ``shared_intermediate_size`` (total width of the shared experts) and ``moe_layers`` (block indices
    with experts). Empty dict for a dense model."""
    if "text_config" in c and "hidden_size" not in c:
        c = c["text_config"]
    experts = next((int(c[k]) for k in MOE_EXPERT_KEYS if c.get(k)), 0)
    if not experts:
        return {}
    n = int(c["num_hidden_layers"])
    if "n_routed_experts" in c:  # DeepSeek: dense blocks first, then every moe_layer_freq-th block
        k, freq = int(c.get("first_k_dense_replace") or 0), int(c.get("moe_layer_freq") or 1)
        layers = [i for i in range(n) if i >= k and i % freq == 0]
        shared = int(c.get("n_shared_experts") or 0)
        shared_width = shared * int(c["moe_intermediate_size"])
    else:  # Mixtral: every block; Qwen-MoE: every decoder_sparse_step-th block not in mlp_only_layers
        step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
        layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        shared_width = int(c.get("shared_expert_intermediate_size") or 0)
        shared = 1 if shared_width else 0
    return {"experts": experts, "experts_per_token": int(c["num_experts_per_tok"]),
            "expert_intermediate_size": int(c.get("moe_intermediate_size") or c["intermediate_size"]),
            "shared_experts": shared, "shared_intermediate_size": shared_width, "moe_layers": layers}


def _unknown_model(model: str, cat: dict, why: str) -> str:
    """The error for a model that is neither a catalog name nor a local path: why, then the catalog names
    that look like it (or a few examples) and the other forms ``model`` may take."""
    key = model.lower()
    like = [n for n in cat if key in n] or difflib.get_close_matches(key, list(cat), n=8, cutoff=0.5)
    names = (f"Catalog names like it: {', '.join(like)}" if like else
             f"The catalog has {len(cat)} models, e.g. {', '.join(list(cat)[:6])}")
    return (f"Unknown model {model!r}. {names} (all: lora_kit.memory.specs.catalog(), offline). Or pass a local "
            f"folder holding config.json, a transformers PretrainedConfig, or a hub id the hub can serve: "
            f"{why.rstrip('.')}.")


def model_is_local(model) -> bool:
    """True for a ``model`` that names a local folder or file (existing, or path-like: it can be no hub id)."""
    from lora_kit.loading import TINY_ALIASES, looks_like_path  # lazy
    if not isinstance(model, (str, os.PathLike)) or os.fspath(model) in TINY_ALIASES:
        return False
    return Path(os.fspath(model)).expanduser().exists() or looks_like_path(os.fspath(model))


def _config_dict(model) -> tuple[str, dict]:
    """(display name, config dict) for any accepted ``model`` form."""
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # PretrainedConfig
        return getattr(model, "name_or_path", "") or model.model_type, model.to_dict()
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a catalog name, a local path, a hub id or a PretrainedConfig; got {model!r}.")
    cat = catalog()
    key = model.lower()
    for name, facts in cat.items():
        if key == name or key == facts["hub_id"].lower():
            return name, catalog_config(name)
    from lora_kit.loading import TINY_ALIASES, read_config_file, resolve_model  # lazy
    p = Path(model).expanduser()
    if model in TINY_ALIASES or model_is_local(model):  # a path that does not exist says so
        path = Path(resolve_model(model)) if not p.is_file() else p
        cfg_file = path if path.is_file() else path / "config.json"
        c = read_config_file(cfg_file)
        # a model of its own code (auto_map) is built from its folder, once the user trusts it
        return model, ({**c, "_name_or_path": str(cfg_file.parent)} if c.get("auto_map") else c)
    from lora_kit.loading import check_hub
    try:  # offline without a cached copy, or an unreachable hub: at once (no ~25 s of retries)
        check_hub(model)
    except ValueError as e:
        raise ValueError(_unknown_model(model, cat, str(e))) from None
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=model in _TRUSTED_CODE)
    except Exception as e:  # noqa: BLE001 - the hub raises many kinds; the message says what to do
        if "trust_remote_code" in str(e):
            raise ValueError(_own_code(model)) from None
        raise ValueError(_unknown_model(model, cat, f"could not read its config from the hub ({type(e).__name__}: "
                                                    f"{_first_line(e)})")) from None
    c = cfg.to_dict()
    return model, ({**c, "_name_or_path": model} if c.get("auto_map") else c)


_TRUSTED_CODE: set[str] = set()


def allow_model_code(model) -> None:
    """Let the planner build ``model`` (a local folder or hub id) with the code it ships (config.json ``auto_map``:
    transformers' ``trust_remote_code=True``) in this process: the user's ``trust_remote_code`` setting, which
    the kit's entry points pass here. That code runs when the kit builds the model on the meta device."""
    if model:
        _TRUSTED_CODE.add(os.fspath(model))
        from lora_kit.loading import resolve_model
        if model_is_local(os.fspath(model)):
            _TRUSTED_CODE.add(str(Path(resolve_model(os.fspath(model))).resolve()))
        _cached_spec.cache_clear()


def _trusted_code(c: dict) -> str | None:
    """The folder or hub id of a config of the model's own code (``auto_map``) the user trusts, else None."""
    where = c.get("_name_or_path")
    if not c.get("auto_map") or not where:
        return None
    local = Path(where).expanduser()
    return where if where in _TRUSTED_CODE or (local.exists() and str(local.resolve()) in _TRUSTED_CODE) else None


def _own_code(model: str) -> str:
    return (f"model {model!r} is defined by its own code (config.json auto_map), which transformers does not ship: "
            "set trust_remote_code=True if you trust that code (it then runs when the kit builds the model), or "
            "use a model transformers knows.")


def _first_line(e: Exception, limit: int = 200) -> str:
    """An exception's first line, cut at ``limit`` characters (transformers lists every model type it knows)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def _family_linears(c: dict, mt: str, h: int, i: int, H: int, kv: int, d: int) -> tuple:
    if mt == "gpt_neox":
        return (Linear("query_key_value", h, 3 * H * d, True, "attn_in"), Linear("dense", H * d, h, True, "attn_out"),
                Linear("dense_h_to_4h", h, i, True, "mlp_in"), Linear("dense_4h_to_h", i, h, True, "mlp_out"))
    mlp_bias = bool(c.get("mlp_bias", False))
    if mt == "phi3":
        return (Linear("qkv_proj", h, (H + 2 * kv) * d, False, "attn_in"), Linear("o_proj", H * d, h, False, "attn_out"),
                Linear("gate_up_proj", h, 2 * i, False, "mlp_in"), Linear("down_proj", i, h, False, "mlp_out"))
    qkv_bias = True if mt == "qwen2" else bool(c.get("attention_bias", False))
    o_bias = False if mt == "qwen2" else bool(c.get("attention_bias", False))
    return (Linear("q_proj", h, H * d, qkv_bias, "attn_in"), Linear("k_proj", h, kv * d, qkv_bias, "attn_in"),
            Linear("v_proj", h, kv * d, qkv_bias, "attn_in"), Linear("o_proj", H * d, h, o_bias, "attn_out"),
            Linear("gate_proj", h, i, mlp_bias, "mlp_in"), Linear("up_proj", h, i, mlp_bias, "mlp_in"),
            Linear("down_proj", i, h, mlp_bias, "mlp_out"))


def spec_from_config(c: dict, name: str = "") -> ModelSpec:
    """ModelSpec from a config dict (``config.json`` contents or ``PretrainedConfig.to_dict()``)."""
    if "text_config" in c and "hidden_size" not in c:
        c = {**c["text_config"], "tie_word_embeddings": c.get("tie_word_embeddings", False)}
    mt = c.get("model_type", "")
    if mt not in KNOWN_TYPES:
        return _generic_spec(c, name)
    h, n, H = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or H) if mt != "gpt_neox" else H
    d = int(c.get("head_dim") or h // H)
    i = int(c["intermediate_size"])
    tied = bool(c.get("tie_word_embeddings", mt in ("gemma", "gemma2")))
    return ModelSpec(
        name=name or mt, model_type=mt, vocab_size=int(c["vocab_size"]), hidden_size=h, intermediate_size=i,
        num_layers=n, num_heads=H, num_kv_heads=kv, head_dim=d, tied_embeddings=tied,
        gated_mlp=mt != "gpt_neox", linears=_family_linears(c, mt, h, i, H, kv, d),
        norms_per_layer=4 if mt == "gemma2" else 2, norm_bias=mt == "gpt_neox",
        parallel_residual=mt == "gpt_neox" and bool(c.get("use_parallel_residual", True)),
        attn_softcap=mt == "gemma2" and c.get("attn_logit_softcapping") is not None,
        final_softcap=mt == "gemma2" and c.get("final_logit_softcapping") is not None,
        embed_scale=mt in ("gemma", "gemma2"),
        extra_params=((d, 2 * n),) if mt == "qwen3" else (),  # qwen3: q_norm and k_norm (head_dim each) per block
        qk_norms=mt == "qwen3", post_mlp_norm=mt == "gemma2", rotary_fraction=_rotary_fraction(c),
        norm_upcast=mt in ("gemma", "gemma2"), config=dict(c))


ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop")  # transformers' attention modules read these


def attention_dropout(cfg) -> tuple[str, float] | None:
    """(field, p) of the config's attention dropout when it is above 0 (transformers applies it in training)."""
    for name in ATTENTION_DROPOUT_FIELDS:
        p = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if isinstance(p, (int, float)) and p > 0:
            return name, float(p)
    return None


def _rotary_fraction(c: dict) -> float:
    """The share of each head's dimensions rotary embeddings turn (1.0 but for partial rotary: GPT-NeoX, Phi)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    nested = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    f = next((v for v in (c.get("partial_rotary_factor"), c.get("rotary_pct"), nested) if v is not None), None)
    return float(f) if f else 1.0


def _generic_spec(c: dict, name: str) -> ModelSpec:
    """Any other causal LM: build it once on the meta device and read its blocks' linears (a linear found in
    only some blocks, like DeepSeek's dense MLP in block 0, records how many); every other tensor (norms,
    MoE routers, fused expert weights) is counted in ``extra_params``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg_kwargs = {k: v for k, v in c.items() if k not in ("model_type", "transformers_version", "architectures",
                                                          "auto_map", "_name_or_path")}
    code = _trusted_code(c)  # the folder (or hub repo) of the model's own code, when the user trusts it
    trusted = code is not None
    try:
        if trusted:
            cfg = AutoConfig.from_pretrained(code, trust_remote_code=True)
        else:
            cfg = AutoConfig.for_model(c.get("model_type", ""), **cfg_kwargs)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trusted)
    except Exception as e:  # noqa: BLE001
        if c.get("auto_map") and not trusted:
            raise ValueError(_own_code(name or c.get("_name_or_path") or c.get("model_type", ""))) from None
        raise ValueError(f"Cannot build model_type={c.get('model_type')!r} with transformers ({_first_line(e)}). "
                         "Pass a config of a causal LM transformers knows, or a catalog name.") from None
    from transformers.pytorch_utils import Conv1D  # GPT-2's linears: weight (in, out)
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    found = {}  # (path in block, in, out, bias) -> number of blocks holding it, in order of first appearance
    for block in layers:
        for lname, mod in block.named_modules():
            if isinstance(mod, (torch.nn.Linear, Conv1D)):
                fin, fout = (mod.in_features, mod.out_features) if isinstance(mod, torch.nn.Linear) else (mod.nx, mod.nf)
                key = (lname, fin, fout, mod.bias is not None)
                found[key] = found.get(key, 0) + 1
    linears = []
    for (lname, fin, fout, bias), count in found.items():
        short = lname.rsplit(".", 1)[-1]
        in_attention = "attn" in lname or "attention" in lname  # GPT-NeoX, Falcon: (self_)attention.dense
        kind = ("attn_out" if short in ("o_proj", "dense", "out_proj", "c_proj") and in_attention
                else "attn_in" if in_attention
                else "mlp_out" if short in ("down_proj", "fc2", "dense_4h_to_h", "c_proj", "w2") else "mlp_in")
        linears.append(Linear(short, fin, fout, bias, kind, 0 if count == len(layers) else count))
    named = [n for n, m in layers[0].named_modules() if "norm" in type(m).__name__.lower()]
    qk = [n for n in named if n.rsplit(".", 1)[-1].startswith(("q_", "k_"))]  # q_norm / k_norm (q_layernorm ...)
    norms = [n for n in named if n not in qk]
    seen, extra = set(), {}
    h = int(cfg.hidden_size)
    V = int(cfg.vocab_size)
    emb = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings().weight if model.get_output_embeddings() is not None else emb
    tied = out_emb is emb
    skip = {id(emb), id(out_emb)} | {id(p) for blk in layers for m in blk.modules()
                                     if isinstance(m, (torch.nn.Linear, Conv1D)) for p in m.parameters()}
    for p in model.parameters():
        if id(p) in skip or id(p) in seen:
            continue
        seen.add(id(p))
        extra[p.numel()] = extra.get(p.numel(), 0) + 1
    H = int(getattr(cfg, "num_attention_heads", 1))
    ffn = max((lin.out_features for lin in linears if lin.kind == "mlp_in"), default=4 * h)
    return ModelSpec(
        name=name or c.get("model_type", "model"), model_type=c.get("model_type", ""), vocab_size=V, hidden_size=h,
        intermediate_size=ffn, num_layers=len(layers), num_heads=H,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or H),
        head_dim=int(getattr(cfg, "head_dim", None) or h // H), tied_embeddings=tied,
        gated_mlp=any(lin.name in ("gate_proj", "w1", "gate_up_proj") for lin in linears),
        linears=tuple(linears), norms_per_layer=len(norms) or 2, norm_bias=False,
        exact=False, extra_params=tuple(sorted(extra.items())), qk_norms=len(qk) == 2,
        post_mlp_norm=any(n.startswith(("post_feedforward", "post_mlp")) for n in norms),
        rotary_fraction=_rotary_fraction(c), norm_upcast=_norm_upcasts(layers[0], norms),
        rotary_fp32=_rotary_stays_fp32(model, h), config=dict(c))


def _last_op(fn) -> str | None:
    """The name of the last operator ``fn()`` dispatches (run on meta tensors: nothing is computed)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Last(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))
    with Last():
        fn()
    return seen[-1] if seen else None


def _norm_upcasts(block, norms: list) -> bool:
    """Whether the block's norm casts back to the input's dtype last (Gemma's and OLMo 2's ``(x * w).to(dtype)``:
    the weight multiply runs in fp32) rather than multiplying the cast-back value by its weight (Llama's), read by
    running the norm once on a meta bf16 tensor."""
    import torch
    mod = block.get_submodule(norms[0]) if norms else None
    w = getattr(mod, "weight", None)
    if w is None:
        return False
    x = torch.empty(1, 2, int(w.shape[-1]), dtype=torch.bfloat16, device="meta")
    try:
        return _last_op(lambda: mod(x)) == "aten::_to_copy"
    except Exception:  # noqa: BLE001  (a norm that needs more than the hidden state: keep Llama's)
        return False


def _rotary_stays_fp32(model, h: int) -> bool:
    """Whether the model's rotary embedding returns fp32 cos / sin for a bf16 input (OLMo 2; Llama casts them to
    the input's dtype), read by calling it once on meta tensors."""
    import torch
    rot = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rot is None:
        return False
    x = torch.empty(1, 2, h, dtype=torch.bfloat16, device="meta")
    try:
        out = rot(x, torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception:  # noqa: BLE001  (another signature: keep Llama's)
        return False
    return isinstance(out, tuple) and getattr(out[0], "dtype", None) == torch.float32


@lru_cache(maxsize=256)
def _cached_spec(key: str) -> ModelSpec:
    name, c = _config_dict(key)
    return spec_from_config(c, name)


def model_spec(model) -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` (catalog name, "tiny", local path, hub id or PretrainedConfig).

    Strings are cached (one config read per process); configs are re-read each call (they are mutable).
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        key = os.fspath(model)
        p = Path(key).expanduser()
        return _cached_spec(str(p.resolve()) if p.exists() else key)
    name, c = _config_dict(model)
    return spec_from_config(c, name)


def valid_targets(spec) -> list[str]:
    """LoRA target module names of one block (what ``lora_targets`` accepts besides "all-linear")."""
    from lora_kit.memory.moe import expert_target_names
    spec = model_spec(spec)
    names = [lin.name for lin in spec.linears] + expert_target_names(spec)  # MoE: experts / router through peft
    return list(dict.fromkeys(names))  # a name can recur (DeepSeek: dense and shared MLP)


SDPA_UNSUPPORTED = ("gemma2",)  # transformers 5.24 refuses sdpa for these (attention soft-capping)


def check_attention(step) -> None:
    """What the kit can plan with ``attn_implementation='flash_attention_2'`` (``lora_kit.memory.flash_attention``):
    unpadded, padded (transformers' unpad path) or packed rows (planned with it only), and 16-bit q/k/v (flash-attn
    takes fp16 / bf16 only; fp32 weights without autocast give fp32 q/k/v). ValueError says what to change."""
    if step.attn_implementation != "flash_attention_2":
        if step.padding == "packed":
            raise ValueError("padding='packed' is planned with attn_implementation='flash_attention_2' (transformers' "
                             "varlen path, what TRL's padding_free runs); set it, or padding='none'.")
        return
    if step.dtype == "float32" and not step.autocast:
        raise ValueError("attn_implementation='flash_attention_2' needs fp16 / bf16 q/k/v; with dtype='float32' set "
                         "autocast=True, or dtype='bfloat16'.")


def check_targets(spec, method: str, lora_rank, lora_targets, attn_implementation: str) -> tuple:
    """The model-dependent half of the step validation (making a ``lora_kit.settings.Step`` is the other):
    LoRA target names that exist in ``spec``, a rank no larger than the smallest targeted layer, an
    attention implementation transformers runs for this architecture. Returns the targeted layer
    names in the model's order (empty for full fine-tuning). ValueError says what to change."""
    spec = model_spec(spec)
    if attn_implementation == "sdpa" and spec.model_type in SDPA_UNSUPPORTED:
        raise ValueError(f"transformers runs {spec.model_type} with eager attention only; "
                         "set attn_implementation='eager'.")
    if method == "full":
        return ()
    names = valid_targets(spec)
    wanted = names if lora_targets == "all-linear" else [lora_targets] if isinstance(lora_targets, str) else lora_targets
    unknown = [t for t in wanted if t not in names]
    if unknown:
        close = {t: difflib.get_close_matches(t, names, n=1) for t in unknown}
        hint = "; ".join(f"did you mean {c[0]!r} for {t!r}?" for t, c in close.items() if c)
        raise ValueError(f"lora_targets {unknown} are not linear layers of {spec.name} ({spec.model_type}); "
                         f"valid names: {names} or 'all-linear'" + (f" ({hint})" if hint else "") + ".")
    targets = tuple(n for n in names if n in wanted)
    experts = set(targets) - {lin.name for lin in spec.linears}  # names that reach only a MoE's experts or router
    floor = min(spec.hidden_size, spec.moe["expert_intermediate_size"]) if experts and spec.moe else 1
    smallest = min((min(lin.in_features, lin.out_features) for lin in spec.linears if lin.name in targets
                    and min(lin.in_features, lin.out_features) > 1), default=floor)  # 1-wide: a MoE shared-expert gate
    if np.any(np.asarray(lora_rank) > smallest):
        raise ValueError(f"lora_rank={int(np.max(lora_rank))} is larger than the smallest targeted layer "
                         f"dimension ({smallest}) of {spec.name}; use lora_rank <= {smallest}.")
    return targets


def load_config(model):
    """A transformers config for ``model`` (PretrainedConfig, config dict, catalog name, "tiny", path, hub id)."""
    from transformers import AutoConfig, PretrainedConfig
    if isinstance(model, PretrainedConfig):
        return model
    _, c = ("", dict(model)) if isinstance(model, dict) else _config_dict(model)
    code = _trusted_code(c)
    if code:  # the model's own code, which the user trusts (allow_model_code)
        return AutoConfig.from_pretrained(code, trust_remote_code=True)
    if c.get("auto_map") and c.get("model_type") not in _transformers_types():
        raise ValueError(_own_code(c.get("_name_or_path") or c.get("model_type", "")))
    c = {k: v for k, v in c.items() if k not in ("transformers_version", "architectures", "_name_or_path", "auto_map")}
    return AutoConfig.for_model(c.pop("model_type"), **c)


def _transformers_types() -> set:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return set(CONFIG_MAPPING_NAMES)


def check_model_step(model, step) -> str:
    """``step`` (a :class:`lora_kit.settings.Step`) checked against ``model`` (:func:`check_targets`, the
    model-dependent half of the step's validation); returns the model's name as ``simulate`` and
    ``measure_config`` record it."""
    spec = model_spec(model) if isinstance(model, (str, os.PathLike, ModelSpec)) else model_spec(load_config(model))
    check_targets(spec, step.method, step.lora_rank, step.lora_targets, step.attn_implementation)
    check_attention(step)
    return model if isinstance(model, str) else getattr(model, "name_or_path", "") or type(model).__name__
