"""Mixture-of-experts: what peft 0.21.2 trains on a MoE block of transformers 5.24 (the adapters, which the static
arithmetic composes from, :mod:`lora_kit.memory.static`), and what a plan says of it. The activations are
``simulate``'s, fitted (:mod:`lora_kit.memory.calibrate`); what follows is what ``simulate`` runs.

**The block transformers runs.** Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2 keep every expert's weights
in two fused 3-D parameters per block (``experts.gate_up_proj``: ``(E, 2*i, h)``, ``experts.down_proj``:
``(E, h, i)``; all experts resident), a router ``gate.weight`` ``(E, h)`` (not an ``nn.Linear``) and, for
Qwen2-MoE / DeepSeek, shared experts that are ordinary gated MLPs. The experts run through transformers'
default ``experts_implementation="grouped_mm"``: the router's top-k gives ``S = T*k`` (token, expert)
pairs, sorted by expert (``perm``, ``perm // k``, the inverse permutation: int64, ``S`` each; the sampled
routing weights; per-expert offsets), the token rows gathered into one ``(S, h)`` tensor, one grouped matmul
``(S, 2*i)``, the gate activation ``(S, i)``, the down grouped matmul ``(S, h)``, multiplied by the routing
weights (fp32 where the router keeps fp32 scores: Mixtral, DeepSeek), put back in token order and summed over
the k experts of each token.

**Routing does not move this peak.** Every buffer above is sized by ``S = T*k``, whatever experts the
tokens pick, so ``simulate`` (whose fake router output has no values) is exact for any token-to-expert
distribution. Measured on real CPU steps (tiny Mixtral, 8 experts, top-2, 512 tokens, LoRA all-linear /
full fine-tuning, checkpointing on and off): a random router and a router forced to send every token to
the same two experts gave byte-identical peaks (49,265,152 B LoRA; 56,308,224 B full). Routing does matter
for ``experts_implementation="eager"`` (a Python loop over the experts hit, each with its own buffers; full
fine-tuning also materializes a full-size gradient per expert hit): there the *spread* routing is the
expensive one (LoRA +1.4 %, full +5.0 % vs all tokens on two experts, same configs), and fake tensors
cannot run it (data-dependent shapes). Neither ``estimate`` nor ``simulate`` models eager experts;
``benchmarks/moe_routing.py`` reproduces these numbers.

**LoRA on experts (peft 0.21.2 with transformers 5.24).** ``target_modules="all-linear"`` matches
``nn.Linear`` layers only, but peft then converts the names of the transformers-4 expert layers to
``target_parameters`` for model types whose conversion pattern is ``mixtral`` or ``qwen2_moe`` (Mixtral,
Qwen3-MoE, DeepSeek-V2/V3, OLMoE, ... -- *not* Qwen2-MoE itself): with "all-linear" every expert's
``gate_up_proj`` (rank doubled: gate and up fused, A ``(2r*E, h)``, B ``(2i, 2r*E)``), ``down_proj``
(A ``(r*E, i)``, B ``(h, r*E)``) and the router (A ``(r, h)``, B ``(E, r)``) get LoRA, and linears named
like the old expert layers (the shared experts' and dense blocks' ``gate_proj`` / ``up_proj`` /
``down_proj``) are *dropped* from the targets. A list naming ``gate_proj``/``up_proj``/``down_proj``
(Mixtral: ``w1``/``w3``/``w2``; the router: ``gate``) does the same; attention-only lists leave experts
frozen. peft's ``ParamWrapper`` adds the update by materializing ``W + B@A`` per expert stack in every
forward (``baddbmm``: a full ``(E, 2i, h)`` and ``(E, h, i)`` copy in the weight dtype, kept for backward),
so LoRA on experts costs a second copy of the block's expert weights per block held (all blocks without
checkpointing) and a full-size weight gradient during its backward.
"""
from __future__ import annotations

from functools import lru_cache

ROLE = {"gate.weight": "router", "gate_up_proj": "gate_up", "down_proj": "down"}  # what peft targets, by name


@lru_cache(maxsize=1)
def peft_expert_tables() -> tuple[dict, dict]:
    """(model type -> conversion pattern, pattern -> {old layer name -> "gate_up" / "down" / "router"}): the model
    types whose experts "all-linear" (and the transformers-4 expert names) target, read from the installed peft
    (its copy of transformers' conversion patterns and its MoE target mapping); empty where peft has none."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:  # a peft without expert LoRA: nothing is trained on experts
        return {}, {}
    names = {p: {old: ROLE[new] for old, new in m.items()} for p, m in _MOE_TARGET_MODULE_MAPPING.items()}
    return {t: p for t, p in _MODEL_TO_CONVERSION_PATTERN.items() if p in names}, names


def _pattern(spec) -> dict | None:
    """The old-name -> role table peft applies to ``spec``'s experts (None: peft trains none of them)."""
    patterns, names = peft_expert_tables()
    p = patterns.get(spec.model_type) if spec.moe else None
    return names[p] if p else None


def expert_target_names(spec) -> list[str]:
    """Names besides the block's linears that ``lora_targets`` may use on ``spec`` to reach its experts or
    router through peft (Mixtral ``w1``/``w2``/``w3``/``gate``; Qwen3-MoE / DeepSeek ``gate``, whose
    ``gate_proj``/``up_proj``/``down_proj`` mean the experts); empty for a dense model."""
    return list(_pattern(spec) or [])


def expert_lora(spec, targets) -> dict:
    """What peft trains in each MoE block for the resolved LoRA ``targets`` (names from ``check_targets``):
    ``{"gate_up", "down", "router": bool, "dropped": linear names peft no longer targets}``."""
    none = {"gate_up": False, "down": False, "router": False, "dropped": ()}
    names = _pattern(spec)
    if not names:
        return none
    hit = {names[t] for t in targets if t in names}
    fused = [t for t, v in names.items() if v == "gate_up"]
    if 0 < sum(t in targets for t in fused) < len(fused):
        raise ValueError(f"peft fuses {' and '.join(fused)} into the experts' gate_up_proj of {spec.name}: target "
                         f"both or neither (lora_targets={list(targets)}).")
    return {"gate_up": "gate_up" in hit, "down": "down" in hit, "router": "router" in hit,
            "dropped": tuple(t for t in targets if t in names)}


def _facts(spec):
    m = spec.moe
    return m["experts"], m["experts_per_token"], m["expert_intermediate_size"], len(m["moe_layers"])


def expert_lora_tensors(spec, flags: dict, r) -> list:
    """(rows, cols, count, elem_bytes) of the fp32 LoRA tensors peft adds to the experts and router."""
    if not (flags["gate_up"] or flags["down"] or flags["router"]):
        return []
    E, k, i, n = _facts(spec)
    h = spec.hidden_size
    out = []
    if flags["gate_up"]:  # rank doubled (gate and up fused), one A/B pair for all experts
        out += [(2 * r * E, h, n, 4), (2 * i, 2 * r * E, n, 4)]
    if flags["down"]:
        out += [(r * E, i, n, 4), (h, r * E, n, 4)]
    if flags["router"]:
        out += [(r, h, n, 4), (E, r, n, 4)]
    return out


def moe_note(spec, method: str, targets="all-linear") -> str:
    """One line for a plan on a MoE model: what the figure assumes about experts (empty for a dense model)."""
    if not spec.moe:
        return ""
    m = spec.moe
    text = (f"{spec.name} is a mixture-of-experts ({m['experts']} experts, top-{m['experts_per_token']}): every "
            "expert's weights are resident; the routing does not change this peak (transformers' grouped_mm "
            "experts size their buffers by tokens x top-k)")
    if method == "qlora":
        text += ("; QLoRA does not quantize the fused expert weights (bitsandbytes replaces nn.Linear only) and "
                 "prepare_model_for_kbit_training up-casts them to fp32, so QLoRA needs more memory than LoRA here")
    elif method == "lora" and _pattern(spec) and targets == "all-linear":
        text += ("; lora_targets='all-linear' puts LoRA on every expert and the router (peft materializes W + BA "
                 "per expert stack each forward); name attention layers only to leave experts frozen")
    return text + "."
