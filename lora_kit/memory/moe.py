"""Mixture-of-experts in the memory model: what a MoE block of transformers 5.24 keeps, and what peft 0.21.2
trains on it. Pure arithmetic (numpy), used by :mod:`lora_kit.memory.estimate`; checked against ``simulate``.

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

import numpy as np

from lora_kit.memory.device import alloc_bytes as _r

# peft 0.21.2 / transformers 5.24: model types whose expert layers "all-linear" (and old expert names) target,
# by conversion pattern (transformers.conversion_mapping._MODEL_TO_CONVERSION_PATTERN, plus peft's "mixtral").
# tests/test_moe.py checks this table against the installed peft on tiny models.
PEFT_EXPERT_PATTERN = {"mixtral": "mixtral", "minimax": "mixtral", "minimax_m2": "mixtral",
                       **{t: "qwen2_moe" for t in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "glm4_moe",
                                                   "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "qwen3_next",
                                                   "flex_olmo", "afmoe")}}
# old (transformers 4) layer name -> what peft targets now ("gate_up" / "down" of the experts, or the router)
PEFT_EXPERT_NAMES = {"mixtral": {"gate": "router", "w1": "gate_up", "w3": "gate_up", "w2": "down"},
                     "qwen2_moe": {"gate": "router", "gate_proj": "gate_up", "up_proj": "gate_up",
                                   "down_proj": "down"}}
NORM_TOPK = {"mixtral": True, "deepseek_v2": False}  # others: the config's norm_topk_prob
FP32_SCORES = ("mixtral", "deepseek_v2", "deepseek_v3")  # routing weights stay fp32: the weighted output is fp32




def expert_target_names(spec) -> list[str]:
    """Names besides the block's linears that ``lora_targets`` may use on ``spec`` to reach its experts or
    router through peft (Mixtral ``w1``/``w2``/``w3``/``gate``; Qwen3-MoE / DeepSeek ``gate``, whose
    ``gate_proj``/``up_proj``/``down_proj`` mean the experts); empty for a dense model."""
    pattern = PEFT_EXPERT_PATTERN.get(spec.model_type) if spec.moe else None
    return list(PEFT_EXPERT_NAMES[pattern]) if pattern else []


def expert_lora(spec, targets) -> dict:
    """What peft trains in each MoE block for the resolved LoRA ``targets`` (names from ``check_targets``):
    ``{"gate_up", "down", "router": bool, "dropped": linear names peft no longer targets}``."""
    none = {"gate_up": False, "down": False, "router": False, "dropped": ()}
    pattern = PEFT_EXPERT_PATTERN.get(spec.model_type) if spec.moe else None
    if not pattern:
        return none
    names = PEFT_EXPERT_NAMES[pattern]
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


def moe_block(spec, method: str, e: int, w: int, flags: dict, T, r, autocast: bool) -> dict:
    """Bytes of one MoE block's routed part (router, dispatch, experts; shared experts are the dense MLP
    machinery's): ``saved`` for backward, the forward transient on top of it (``forward``), the backward
    transient inside the block (``backward``, on top of what the block saved) and, with checkpointing, the
    transient where the block's recomputed forward holds most (``recompute``, on top of what the block saved and
    the stream), arrays over ``T`` / ``r``. ``backward`` is DeepSeek's; the other families take ``backward_first``
    (the backward's first op) and ``backward_late`` (the moments after the down projection's backward, with full
    fine-tuning's weight gradients of the block made by then), and ``recompute_locals`` on top of ``recompute``.

    ``e``: bytes of the stream's dtype; ``w``: of the expert weights (QLoRA: fp32, as
    ``prepare_model_for_kbit_training`` up-casts every non-quantized parameter)."""
    E, k, i, _ = _facts(spec)
    h, mt = spec.hidden_size, spec.model_type
    S = T * k
    full = method == "full"
    gu, dn, rt = (full or flags["gate_up"]), (full or flags["down"]), (full or flags["router"])
    norm_topk = NORM_TOPK.get(mt, bool(spec.config.get("norm_topk_prob", False)))
    sw = 4 if mt in FP32_SCORES else e  # routing weights' dtype
    ow = 4 if mt in FP32_SCORES else e  # weighted expert output's dtype (promoted by fp32 weights)
    # router: fp32 softmax (saved), top-k indices (saved), renormalisation (a clone and the sum, saved)
    saved = _r(T * E * 4) + _r(T * k * 8) + (_r(T * k * 4) + _r(T * 4) if norm_topk else 0)
    if mt.startswith("deepseek"):  # scores scaled by routed_scaling_factor: a new (T, k) fp32
        saved = saved + 0 * T
    if rt:  # the router's weight needs a gradient: its input is kept (DeepSeek: an fp32 copy; under autocast the
        # router's linear keeps its own 16-bit cast)
        saved = saved + (_r(T * h * 2) if autocast else _r(T * h * 4) if mt.startswith("deepseek") else
                         (0 if full else _r(T * h * e)))
        if not full:  # peft: W + B@A of the router, in its dtype
            saved = saved + _r(E * h * w)
    # dispatch: perm, perm // k, inverse perm (int64), gathered routing weights, per-expert offsets (int32)
    saved = saved + 3 * _r(S * 8) + _r(S * sw) + _r(E * 4)
    # experts: gate_up output (gate and up views), activation, down output (kept by the routing-weight multiply)
    saved = saved + _r(S * 2 * i * e) + _r(S * i * e) + _r(S * h * e)
    if gu:  # the gathered rows: the up-projection's weight gradient needs them
        saved = saved + _r(S * h * e)
    if dn:  # act(gate) * up: the down-projection's weight gradient needs it
        saved = saved + _r(S * i * e)
    if not full:  # peft's ParamWrapper: W + B@A per expert stack (baddbmm), plus bf16 copies of the factors
        cast = w != 4
        if flags["gate_up"]:
            saved = saved + _r(E * 2 * i * h * w) + (_r(E * 2 * i * 2 * r * w) + _r(E * 2 * r * h * w) if cast else 0)
        if flags["down"]:
            saved = saved + _r(E * h * i * w) + (_r(E * h * r * w) + _r(E * r * i * w) if cast else 0)
    if spec.config.get("shared_expert_intermediate_size"):  # Qwen2-MoE: sigmoid(gate(x)) * shared expert output
        # both come out of linears: 16-bit under autocast (QLoRA: fp32, peft's sum with the fp32 base output)
        el = 2 if autocast and method != "qlora" else e
        saved = saved + _r(T * h * el) + _r(T * el)
    # forward, end of the experts: the weighted output and its copy in token order; the experts function's
    # locals (the gathered rows) and the router logits are still alive
    fwd = 2 * _r(S * h * ow) + (0 if gu else _r(S * h * e)) + _r(T * E * (4 if mt.startswith("deepseek") else e))
    # backward, first op of the experts: grad of the summed output expanded to (T, k, h) (a copy), then the
    # token-order gather's backward: zeros (S, h) and index_put into them
    bwd = 3 * _r(S * h * ow)
    first = bwd
    # then inside the gate activation's backward: the down projection's input gradient and the two gradients of
    # act(gate) * up, once the down output is freed (wide experts: Mixtral)
    bwd = np.maximum(bwd, 3 * _r(S * i * e) - _r(S * h * e))
    if gu:  # the up projection's weight gradient, a full (E, 2i, h) tensor, once the down projection's part is freed
        down_part = _r(S * i * e) + _r(S * h * e) + (_r(E * h * i * w) if flags["down"] and not full else 0)
        bwd = np.maximum(bwd, _r(E * 2 * i * h * w) + _r(S * h * e) + _r(S * 2 * i * e) - down_part)
    # the moments after the first op, as the trace shows them (``backward`` above is kept for DeepSeek, whose MoE
    # moments are modelled apart): once the down projection's backward has run, what it alone kept is freed -- the
    # routed output it made (``S x h``), with ``dn`` the product act(gate) * up its weight gradient read and, with
    # LoRA on it, peft's W + B@A (and its factors' 16-bit copies); full fine-tuning keeps that weight gradient
    # (the block's own, made by then). (a) the down projection's backward: its input gradient and the weight
    # gradient (full: kept; LoRA: W + B@A's, a transient); (b) the gate activation's: its input gradient and act *
    # up's two gradients; (c) the up projection's weight gradient (E, 2i, h) with its input gradient (S, h), the
    # gate/up output and the activation freed (their gradient, cat's (S, 2i), takes the output's place)
    lora_dn = _r(E * h * i * w) + (_r(E * h * r * w) + _r(E * r * i * w) if w != 4 else 0) \
        if flags["down"] and not full else 0
    own_dn = _r(E * h * i * w) if full else 0
    freed = _r(S * h * e) + (_r(S * i * e) if dn else 0) + lora_dn
    late = _r(S * i * e) + (_r(E * h * i * w) if dn else 0)
    late = np.maximum(late, 3 * _r(S * i * e) - freed + own_dn)
    if gu:
        late = np.maximum(late, _r(E * 2 * i * h * w) + _r(S * h * e) - _r(S * i * e) - freed + own_dn)
    # a checkpoint's recomputed forward (non-reentrant, early stop) runs only up to the block's last saved tensor. With
    # nothing saved after the routed experts (Mixtral, Qwen3-MoE) it stops before putting their output back in token
    # order, with the backward's copy of the output gradient (``(T, k, h)``, taken before the recompute), the weighted
    # output and the dispatch's locals live: as large as ``forward`` (the stream: residual, norm output and the
    # gradient at the block's output). Qwen2-MoE's shared-expert gate saves after them, so its recompute reaches the
    # experts' end (``forward``, no copy taken yet), with the gradient at the block's output waiting beside the stream
    # (residual, norm output, shared expert output) and the gate's sigmoid not made yet (``saved`` counts it and
    # the shared expert output the gating multiply keeps). DeepSeek (shared experts after the routed ones): ``forward``.
    recompute = fwd + _r(T * h * e) - _r(T * h * e) - _r(T * e) if spec.config.get("shared_expert_intermediate_size") \
        else fwd
    # Qwen2-MoE runs its shared expert before the routed ones: its backward (the dense MLP's moments) comes after the
    # routed experts' backward has freed what the block saved for them (``saved``)
    shared_first = bool(spec.config.get("shared_expert_intermediate_size"))
    # the experts function's other locals at the recompute's last moment (not DeepSeek's, modelled apart): the sorted
    # expert ids (int64), histc's float input and its counts, the routing weights cast to the stream's dtype (not
    # where they stay fp32) and, where the recompute stops at the inverse permutation (no shared expert), its arange
    rec_locals = _r(S * 8) + _r(S * 4) + _r(E * 4) + (0 if mt in FP32_SCORES else _r(T * k * e)) + \
        (0 if shared_first else _r(S * 8))
    return {"saved": saved, "forward": fwd, "backward": bwd, "recompute": recompute, "shared_first": shared_first,
            "backward_first": first, "backward_late": late, "recompute_locals": rec_locals}


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
    elif method == "lora" and PEFT_EXPERT_PATTERN.get(spec.model_type) and targets == "all-linear":
        text += ("; lora_targets='all-linear' puts LoRA on every expert and the router (peft materializes W + BA "
                 "per expert stack each forward); name attention layers only to leave experts frozen")
    return text + "."
