"""``simulate``: one real training step of the real architecture on fake tensors, measured.

How it works: the model is built from its config on the meta device (transformers
``from_config``), adapted there (peft LoRA; for QLoRA transformers' ``replace_with_bnb_linear`` +
``prepare_model_for_kbit_training`` first), then every parameter and buffer is replaced by a
``FakeTensor`` of the same shape and dtype (``module.to()`` under FakeTensorMode fails in torch
2.13). The first step is reduced to what it leaves behind (zero gradients + one optimizer step
create the optimizer state: half the time, same state); the second, real training step
(:func:`lora_kit.memory.measure.train_step`, the same code a real measurement runs) executes under
``FakeTensorMode`` with a :class:`~lora_kit.memory.tracker.LiveBytesTracker`, and its peak is the result.
Nothing is allocated and no kernel runs; cost is Python overhead per operator (about 20k operators
for an 8B LoRA step: see ``benchmarks/simulate_speed.py`` for measured times).

What is exact: every tensor the real code creates (weights, peft adapters, gradients, the real
optimizer's state, saved activations, logits, loss, temporaries), with transformers' and peft's own
code paths for any causal LM transformers can build from a config, and each storage rounded to 512
bytes like the CUDA caching allocator.

QLoRA: bitsandbytes 4-bit weights are quantized by bitsandbytes' own ``quantize_4bit`` under
FakeTensorMode (its ops register fake kernels), so packed weights and every absmax / code / offset
tensor have exactly the layout a real load produces, and its ``MatMul4Bit`` runs on them.
The 8-bit / paged optimizers are bitsandbytes' own classes on fake tensors too; paged buffers
(state buffers of parameters with >= 1e5 elements) live in CUDA managed memory that
``max_memory_allocated`` does not count, so they are left out of the peak and reported in ``notes``.

Limits (stated, measured where possible by ``benchmarks/gpu_validate.py``):

- the kernels are the CPU ones: SDPA takes the CPU flash-attention path (saves the output and an
  fp32 logsumexp, like CUDA's flash / memory-efficient kernels); autocast follows the CPU autocast
  op lists, which differ from CUDA's in a few ops;
- attention dropout (a config's ``attention_dropout`` > 0) with SDPA is simulated at p = 0: CUDA's fused kernels
  apply it inside the kernel and keep what they keep without it (plus a 16-byte RNG state), while the CPU's flash
  kernel takes no dropout, so a real CPU step runs the math kernel and holds ``seq x seq`` probabilities and their
  dropout mask per head (``measure_config`` measures that; :func:`attention_dropout` names the field);
- memory allocated inside kernels (cuBLAS / cuDNN workspaces, NCCL buffers) is not a tensor and is
  not seen; nor are the tensors an opaque operator makes and frees inside itself (bitsandbytes' 4-bit matmul
  dequantises its weight there, on the CPU and in CUDA's path for training-sized micro-batches): ``trace=True``
  records them per operator (``SimResult.temporaries``), ``lora_kit.memory.cuda_kernels.kernel_extra`` places
  them; ``device_total_bytes`` adds the CUDA context, reserved and outside memory analytically
  (:mod:`lora_kit.memory.device`);
- padding: the batch is the one :func:`~lora_kit.memory.measure.step_batch` builds for ``padding``
  (a real attention mask with padded rows, fed as constant fake tensors), so transformers takes the
  path it takes on a padded batch: a ``[batch, 1, seq, seq]`` mask, SDPA's per-layer cast of it, and
  K/V repeated to every query head (GQA off with a mask); with ``padding="none"`` there is no mask;
- mixture-of-experts: the real transformers MoE block runs, with its default ``grouped_mm`` experts. The
  fake router's top-k has shapes but no values, so no token-to-expert distribution is assumed: every
  dispatch buffer is sized by tokens x top-k whichever experts the tokens pick, and real CPU steps with
  a spread router and with every token on the same two experts peak byte-identically, equal to this
  simulation (``benchmarks/moe_routing.py``, :mod:`lora_kit.memory.moe`). ``experts_implementation=
  "eager"`` (a loop over the experts hit, whose peak does depend on the routing) is not simulated;
- sharding: one GPU (``none``) and ``ddp`` (+ DDP's gradient buckets, as large as the gradients,
  added analytically) are simulated here; ``fsdp`` / ``zero3`` / ``zero2`` run PyTorch's FSDP2 on a
  fake process group of ``num_gpus`` ranks (:mod:`lora_kit.memory.sharded` says how each value maps
  onto FSDP2); ``zero1``, ``cpu_offload`` and QLoRA with sharding stay ``estimate``'s arithmetic.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lora_kit.fsdp import SIMULATED
from lora_kit.loading import DTYPE_MAP, bnb_config
from lora_kit.memory import liger
from lora_kit.memory.breakdown import BREAKDOWN_KEYS, label_training_state, to_breakdown
from lora_kit.memory.device import device_kwargs, device_total
from lora_kit.memory.flash_attention import values_known
from lora_kit.memory.measure import check_liger, step_batch
from lora_kit.memory.sharded import check_simulable, simulate_sharded
from lora_kit.memory.specs import attention_dropout, check_model_step, load_config, model_spec
from lora_kit.memory.tracker import LiveBytesTracker
from lora_kit.noise import quieted_call
from lora_kit.settings import Step, as_step
from lora_kit.trainer_loops import loop_parts
from lora_kit.training import attach_adapter, autocast_context, loop_batch, loop_inputs, train_step



@dataclass
class SimResult:
    peak_allocated_bytes: int  # what torch.cuda.max_memory_allocated() would report for the step
    device_total_bytes: int  # what the process adds to the card: lora_kit.memory.device
    breakdown: dict  # estimate's six keys, composition at the peak moment; sums to the peak
    phase: str  # "forward" | "backward" | "optimizer": the phase holding the peak
    wall_seconds: float  # time simulate took
    settings: dict  # the arguments used
    notes: list = field(default_factory=list)  # what was approximated or left out
    collectives: dict = field(default_factory=dict)  # sharded: buffer bytes all-gathered / reduce-scattered per step
    trace: list | None = None  # trace=True: per operator of the step, (phase, operator, live bytes, parts): see simulate
    allocations: list | None = None  # trace=True: (phase, operator, bytes) per new storage (tracker.allocations)
    # trace=True: operator index -> bytes an opaque operator holds inside itself beside its outputs (not in ``trace``'s
    # live bytes; tracker.KERNEL_TEMPORARIES: bitsandbytes' gemm_4bit dequantising its weight)
    temporaries: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _meta_model(cfg, s):
    from transformers import AutoModelForCausalLM
    from lora_kit.memory.flash_attention import FA2, check_supported, model_attn_implementation
    weight_dtype = "float32" if s.method == "full" and s.autocast else s.dtype
    try:
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE_MAP[weight_dtype],
                                                 attn_implementation=model_attn_implementation(s.attn_implementation),
                                                 # a config of the model's own code comes from load_config only
                                                 # once the user trusts it (lora_kit.memory.specs.allow_model_code)
                                                 trust_remote_code=bool(getattr(cfg, "auto_map", None)))
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
        other = "eager" if s.attn_implementation == "sdpa" else "sdpa"
        raise ValueError(f"transformers has no attn_implementation={s.attn_implementation!r} for model_type="
                         f"{cfg.model_type!r}; pass attn_implementation={other!r}.") from None
    if s.attn_implementation == FA2:
        check_supported(m)
    if s.method == "qlora":
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers.base import _assign_is_quantized, get_keys_to_not_convert

        replace_with_bnb_linear(m, modules_to_not_convert=get_keys_to_not_convert(m),
                                quantization_config=bnb_config(s.dtype, s.double_quant, not s.kbit_prepared))
        m.is_loaded_in_4bit = True
        _assign_is_quantized(m)  # what from_pretrained's quantizer marks (flash attention's target dtype reads it)
    return m


def _fake_param(p, fake_mode, dtype):
    """A fake twin of parameter ``p`` (4-bit weights quantized by bitsandbytes on fake tensors)."""
    with fake_mode:
        if type(p).__name__ == "Params4bit":
            import bitsandbytes.functional as F
            w = torch.empty(tuple(p.shape), dtype=dtype)
            packed, qs = F.quantize_4bit(w, blocksize=p.blocksize, compress_statistics=p.compress_statistics,
                                         quant_type=p.quant_type, quant_storage=p.quant_storage)
            new = torch.nn.Parameter(packed, requires_grad=False)
            for k in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
                setattr(new, k, getattr(p, k))
            new.quant_state, new.bnb_quantized = qs, True
            return new
        return torch.nn.Parameter(torch.empty(tuple(p.shape), dtype=p.dtype), requires_grad=p.requires_grad)


def _fakeify(model, fake_mode, dtype) -> None:
    """Replace every parameter and buffer by a fake tensor (ties preserved)."""
    import bitsandbytes.functional as F
    if "dynamic" not in F.name2qmap:  # bitsandbytes caches this map globally: keep the real one there
        F.name2qmap["dynamic"] = F.create_dynamic_map()
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = _fake_param(p, fake_mode, dtype)
                mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                with fake_mode:
                    mod._buffers[name] = torch.empty(tuple(b.shape), dtype=b.dtype)


def _optimizer_warmup(model, optimizer) -> None:
    """What a first step leaves behind, without its forward and backward (half the simulation
    time): zero gradients, one optimizer step (creates the state), ``zero_grad(set_to_none=True)``.
    Nothing else survives a step; tests check the result equals a real two-step run."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _real_mask_decisions(has_padding: bool):
    """Let transformers decide about masks as it decides on the real batch. It looks for packed sequences
    by reading position_ids' values, which fake tensors do not have, and would build a 4-D mask a real
    unpacked batch never gets: there are none. It skips SDPA's 4-D mask when the 2-D attention mask has no
    padding, a test it cannot run on a fake mask (it builds the mask then): the answer is read from the
    real batch (``has_padding``) and given to it; with padding it builds the mask, as on real tensors.
    FlashAttention-2's mask function drops a 2-D mask that is all ones (``attention_mask.all()``, the same test on
    values): without padding it is handed no mask, which is what it returns on the real batch; with padding it returns
    the mask's last key-length columns, which it keeps on the real batch (its test's 0-d result still made)."""
    try:
        from transformers import masking_utils
    except ImportError:  # older transformers: nothing to patch
        yield
        return
    patches = {"find_packed_sequence_indices": lambda position_ids: None}
    skip = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if skip is not None and not has_padding:
        patches["_ignore_causal_mask_sdpa"] = lambda padding_mask, *a, **k: skip(None, *a, **k)
    orig = {k: getattr(masking_utils, k) for k in patches if hasattr(masking_utils, k)}
    for k in orig:
        setattr(masking_utils, k, patches[k])
    from lora_kit.memory.flash_attention import KIT_NAME
    masks = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    fa_mask = masks[KIT_NAME] if masks is not None and KIT_NAME in masks else None
    local = fa_mask is not None and KIT_NAME in getattr(masks, "_local_mapping", {})  # else registered globally
    if fa_mask is not None:
        def real_batch_mask(*args, attention_mask=None, **kw):
            kv_length = kw["kv_length"] if "kv_length" in kw else args[2]
            if attention_mask is not None and attention_mask.shape[-1] == kv_length:
                if has_padding:  # flash_attention_mask's slice and test, answered from the real batch: kept
                    attention_mask = attention_mask[:, -kv_length:]
                    attention_mask.all()
                    return attention_mask
                attention_mask = None  # all ones: the real batch has no padding
            return fa_mask(*args, attention_mask=attention_mask, **kw)
        masks[KIT_NAME] = real_batch_mask
    try:
        yield
    finally:
        for k, v in orig.items():
            setattr(masking_utils, k, v)
        if fa_mask is not None:
            if local:
                masks[KIT_NAME] = fa_mask
            else:  # the override lived in this instance's local mapping only: the global registration shows again
                del masks[KIT_NAME]


@contextlib.contextmanager
def _grouped_mm_any_dtype():
    """Let fake tensors run ``torch._grouped_mm`` (transformers' MoE experts) on fp32 / fp16 inputs, as the real
    CPU kernel does: torch's meta kernel accepts bf16 only (the CUDA kernel's rule), so a QLoRA MoE step, whose
    experts ``prepare_model_for_kbit_training`` up-casts to fp32, would stop on fake tensors while the real CPU
    step runs. Same output shape and layout as the meta kernel's (its own helper builds it)."""
    import torch._meta_registrations as meta
    orig = meta._meta_grouped_mm_common

    def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, **kw):
        if scale_a is None and scale_b is None and mat_a.dtype == mat_b.dtype and mat_a.dtype != torch.bfloat16:
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return orig(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, **kw)
    meta._meta_grouped_mm_common = common
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = orig


def _tracked_step(net, opt, batch, fake_mode, ctx, has_padding: bool, paged: bool, loop_kw=None,
                  loop_live=(), trace: bool = False) -> LiveBytesTracker:
    """One GPU's steady-state step on fake tensors: the optimizer state a first step leaves, then the tracked step
    (``loop_kw``: the loop's clipping and loss, ``loop_live``: its already-live tensors; ``memory.loops``)."""
    tracker = LiveBytesTracker(trace=trace)
    with fake_mode, _real_mask_decisions(has_padding), _grouped_mm_any_dtype():
        _optimizer_warmup(net, opt)  # "step 1": the optimizer state a first step leaves behind
        label_training_state(tracker, net, opt, paged=paged)
        tracker.track([*batch.values(), *loop_live])
        tracker.reset_peak()
        with tracker:
            train_step(net, batch, opt, tracker=tracker, autocast_ctx=ctx,
                       on_grads=lambda: label_training_state(tracker, net), **(loop_kw or {}))
    return tracker


@quieted_call
def simulate(model, step: Step | None = None, *, fsdp_policy: str = "accelerate", trace: bool = False,
             **overrides) -> SimResult:
    """Peak memory of one steady-state training step, from a real step on fake tensors.

    Same arguments and result fields as :func:`lora_kit.memory.estimate` (``model``, a ``Step`` and step
    fields overriding it). ``grad_accum`` does not change the peak (each micro-step frees its activations;
    gradients are accumulated in place) and is recorded only. See the module docstring for what is exact.
    ``fsdp_policy`` (sharded steps): "accelerate" (accelerate's FSDP2 wrapping, what the kit's launcher runs) or
    "layers" (every decoder layer, then the root, all resharded after forward: the plain ``fully_shard`` recipe);
    ``lora_kit.fsdp`` describes both. ``trace`` (one GPU): keep the live bytes after each operator of the step
    (``SimResult.trace``: (phase, operator, bytes, parts) in order, ``parts`` the bytes of the first five
    ``BREAKDOWN_KEYS`` then, the rest being activations; paged states left out as from the peak; what
    ``lora_kit.memory.calibrate`` fits), and ``SimResult.allocations``, the storages each operator returned, in order
    (equal item for item to a real step's ``MeasureResult.allocations`` when the same kernels run).
    """
    s = as_step(step, **overrides)
    name = check_model_step(model, s)
    t0 = time.perf_counter()
    method, dtype, autocast, sharding = s.method, s.dtype, s.autocast, s.sharding
    if sharding not in ("none", "ddp") + SIMULATED:
        raise ValueError(f"simulate covers sharding='none', 'ddp' and (on FSDP2) {', '.join(map(repr, SIMULATED))}; "
                         f"for sharding={sharding!r} use lora_kit.memory.estimate (a one-GPU fit composed).")
    if sharding in SIMULATED:
        check_simulable(s)
        if s.loop != "kit":
            raise ValueError(f"simulate runs sharding={sharding!r} with loop='kit'; for loop={s.loop!r} under "
                             "sharding use lora_kit.memory.estimate.")
    cfg = load_config(model)
    if s.liger_kernel:
        check_liger(cfg, s)
    drop = attention_dropout(cfg) if s.attn_implementation == "sdpa" else None
    if drop:
        cfg = copy.deepcopy(cfg)
        setattr(cfg, drop[0], 0.0)
    net = _meta_model(cfg, s)
    with torch.device("meta"):
        net = attach_adapter(net, method, 0, s.lora_rank, s.lora_alpha, s.lora_dropout, s.lora_targets,
                             s.gradient_checkpointing, s.kbit_prepared)
    net.train()
    if s.liger_kernel:
        liger.apply(net, fused_linear_cross_entropy=s.loop != "sft")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fakeify(net, fake_mode, DTYPE_MAP[dtype])
    paged = s.optimizer.startswith("paged_")
    opt, loop_kw, loop_live = (None, {}, []) if sharding in SIMULATED else loop_parts(net, s, "cpu")
    # the batch a collator builds (real values: the padding mask's values decide what transformers builds),
    # as constant fake tensors: shapes for the step, values for the few reads of them (the token count)
    real = loop_inputs(step_batch(torch.randint(0, cfg.vocab_size, (s.batch_size, s.seq_len)), s.padding),
                       s.loop)
    has_padding = "attention_mask" in real and not bool(real["attention_mask"].all())
    memo = {}
    batch = {k: memo.setdefault(id(v), fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, v, make_constant=True))
             for k, v in real.items()}
    ctx = autocast_context(autocast, dtype, "cpu")
    with values_known(batch, real):  # packed rows: FlashAttention-2's path reads position_ids' values
        if sharding in SIMULATED:  # the real FSDP2 on a fake world of num_gpus ranks: lora_kit.memory.sharded
            with _real_mask_decisions(has_padding):
                tracker = simulate_sharded(net, batch, s, fake_mode, ctx, fsdp_policy, trace)
        else:
            tracker = _tracked_step(net, opt, loop_batch(batch, s.loop), fake_mode, ctx, has_padding, paged,
                                    loop_kw, loop_live, trace)
    raw = tracker.peak_breakdown()
    notes = []
    paged_bytes = raw.pop("paged_optimizer_states", 0)
    if paged_bytes:
        notes.append(f"{paged_bytes} bytes of paged optimizer state live in CUDA managed memory: not in "
                     "max_memory_allocated, evicted to host memory under pressure; left out of the peak.")
    bd = to_breakdown(raw)
    if sharding == "ddp" or sharding == "none" and s.num_gpus > 1:  # "none" on several GPUs runs DDP
        grad_bytes = sum(-(-p.numel() * p.element_size() // 512) * 512 for p in net.parameters() if p.requires_grad)
        bd["gradients"] += grad_bytes
        notes.append(f"ddp: {grad_bytes} bytes of DDP gradient buckets added analytically (as large as the gradients).")
    if sharding in SIMULATED:
        c = tracker.collectives
        notes.append(f"{sharding}: PyTorch FSDP2 on a fake process group of {s.num_gpus} ranks; rank 0's peak "
                     f"(the largest shard); {fsdp_policy!r} wrapping (lora_kit.fsdp). Per step it "
                     f"all-gathered {c['all_gather_bytes']} and reduce-scattered {c['reduce_scatter_bytes']} buffer "
                     "bytes (a ring moves (N-1)/N of them per rank).")
    if s.liger_kernel:
        notes.append("liger_kernel: Liger's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy as their Python code "
                      "allocates and saves (lora_kit.memory.liger); RMSNorm's backward buffer sized for "
                      f"{liger.RMS_NORM_SM_COUNT} SMs (an H100-SXM / H200).")
    if drop:
        notes.append(f"{drop[0]}={drop[1]:g}: simulated at 0, as CUDA's fused attention kernels hold the same tensors "
                     "with dropout; a CPU step runs SDPA's math kernel instead and holds more.")
    if autocast:
        notes.append("autocast follows the CPU autocast op lists (CUDA's differ in a few ops).")
    if s.kbit_prepared:
        notes.append("QLoRA includes prepare_model_for_kbit_training's fp32 up-casts of norms, embeddings and lm_head.")
    elif method == "qlora":
        notes.append("QLoRA without prepare_model_for_kbit_training (qlora_prepare='none'): norms, embeddings and "
                     f"lm_head in {dtype}, adapters in bf16, the 4-bit weights stored in {dtype}.")
    peak = sum(bd.values())
    assert set(bd) == set(BREAKDOWN_KEYS)
    steps = None
    if trace:
        parts = tracker.trace_parts(BREAKDOWN_KEYS[:5] + ("paged_optimizer_states",))
        steps = [(ph, op, live - p[-1], p[:-1]) for (ph, op, live), p in zip(tracker.trace, parts)]
    total = device_total(int(peak), **device_kwargs(model_spec(model), s))
    return SimResult(int(peak), total, bd, tracker.peak_phase, time.perf_counter() - t0,
                     {"model": name, **s.to_dict()}, notes,
                     getattr(tracker, "collectives", {}), steps,
                     tracker.allocations() if tracker.trace is not None else None,
                     dict(tracker.temporaries) if tracker.trace is not None else None)
