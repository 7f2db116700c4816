"""Step time from the kernels CUDA runs: each matmul at its dtype's peak, attention at the kernel SDPA picks,
element-wise traffic at memory bandwidth, QLoRA's dequantisation per pass, the optimizer by bytes moved.

One training step on one GPU (``T = batch_size * seq_len`` tokens per micro-step; ``grad_accum`` micro-steps,
then one optimizer step). A kernel's device time is its roofline,
``max(FLOPs / (peak * matmul_efficiency), bytes / (bandwidth * bandwidth_efficiency))`` (at least
``KERNEL_MIN_SECONDS``). Eager PyTorch dispatches kernels from Python one by one while the device runs the ones
already queued: each pass (forward; backward with its recompute) takes ``max(device seconds, kernels *
host_seconds_per_kernel)``, so short sequences are host-bound (the flat floor of the Qwen README's rows at 256-1024
tokens) and long ones device-bound; the host-bound excess is the part ``host_wait``.

- **Matmuls** by shape ``T x in x out`` and the dtype they really run in, their output computed in
  ``GEMM_TILE``-square tiles in waves over the GPU's SMs (``SM_COUNT``; the last wave partly idle: short sequences
  and narrow layers reach less of the peak): base linears in the compute dtype
  (tensor-core ``bf16_tflops`` / ``fp16_tflops``); LoRA's A and B in the adapter dtype (fp32: peft keeps adapters
  in fp32; 16-bit under autocast); with QLoRA's usual recipe (``prepare_model_for_kbit_training``) also ``lm_head`` in fp32. fp32
  matmuls run on CUDA cores (``allow_tf32`` is off by default): ``FP32_TFLOPS`` of
  :mod:`lora_kit.plan.time_constants`. Backward: input gradients for every linear, weight gradients for trained
  ones (full fine-tuning; LoRA's A and B).
- **Attention** at the kernel CUDA's SDPA picks (:func:`lora_kit.memory.cuda_kernels.sdpa_backend`):
  FlashAttention for fp16/bf16 on sm80+ (causal half skipped, backward 2.5x forward) at
  ``attention_efficiency`` of the tensor peak; in fp32 (QLoRA's recipe without autocast; CUDA's autocast casts
  SDPA's inputs to bf16) the memory-efficient kernel for MHA and for masked GQA (transformers repeats K/V), and
  for unmasked GQA (``enable_gqa``) the **math** kernel before torch 2.14: full S x S scores in fp32 on CUDA
  cores plus their traffic. ``attn_implementation="eager"`` is the math path in the activation dtype.
  ``"flash_attention_2"`` (flash-attn, called by transformers without SDPA) is the flash kernel in the dtype it
  receives (:func:`lora_kit.memory.cuda_kernels.flash_attention_dtype`: 16-bit), plus, for fp32 q/k/v (QLoRA's
  recipe), their casts to 16-bit and the gradients' casts back at bandwidth.
- **Element-wise and norm traffic** (RMSNorm in fp32 internally, rotary, residual adds, SiLU x up, LoRA's casts
  and adds operator by operator, the loss's fp32 logits) at bandwidth; activations are fp32 under QLoRA's recipe,
  the residual stream stays in the weights' dtype under autocast. What is counted (FLOPs by dtype, bytes per
  stage) is checked against the operators of a real step (``benchmarks/time_counts.py``,
  ``device_parts(...)["counts"]``).
- **Mixture-of-experts blocks** (:func:`_experts`): the router, the grouped expert matmuls over tokens x top-k,
  the gather and the sum back; LoRA on the experts materializes ``W + B @ A`` per expert stack.
- **QLoRA under autocast** (HF Trainer ``bf16=True``): every linear, ``lm_head`` included, runs in 16-bit (the
  fp32 ``lm_head`` weight cast per use); without autocast ``lm_head`` and the adapters run in fp32.
- **QLoRA dequantisation**: every pass through a 4-bit linear (forward, backward, the recomputed forward)
  expands its NF4 weights to bf16: ``(0.5 + 2) bytes`` per weight at bandwidth, times ``dequant_factor``
  (bitsandbytes' measured cost over that bound).
- **Checkpointing**: the decoder blocks' forward runs again in backward. Non-reentrant checkpointing (the kit's
  loop; ``use_reentrant=False``) recomputes a block lazily, from inside backward, when the autograd engine first
  unpacks one of the block's saved tensors: its Python forward runs again and, for every tensor the block saves,
  ``torch.utils.checkpoint``'s Python hooks run (the recompute's pack hook, the determinism check of the recomputed
  tensors' metadata, the unpack hook). The device waits for that host work (the H200 rows show it is not hidden
  even at 8k tokens): :func:`recompute_host_calls` host dispatches per recomputed kernel (``time_constants``:
  counted from checkpoint.py and the saved tensors of a block, not fitted), at the same ``host_seconds_per_kernel``
  as every other dispatch (in ``host_wait``). The recompute stops early, before the block's last matmul that saves
  an input (:func:`_last_saving_linear`). Reentrant checkpointing (``reentrant_checkpointing=True``) recomputes
  the whole block with a plain forward, without those hooks.
- **L2 cache**: element-wise traffic whose working set fits in the GPU's L2 (``time_constants.L2_MB``) moves at
  ``l2_speedup`` x DRAM bandwidth (Ada's large L2 matters at short sequences); a larger one streams at DRAM's.
- **Optimizer**: ``torch.optim.AdamW(foreach=True)`` moves 20 state-sized passes per trainable element (in the
  trained parameters' dtype); bitsandbytes' 8-bit optimizers are fused (10 bytes per parameter).
- **Several GPUs**: this is each GPU's step; :mod:`lora_kit.plan.multi_gpu` adds the communication.

The ``FITTED`` constants are the same for every GPU; a GPU enters only through its datasheet peaks.
``benchmarks/time_published.py`` fits them on published and measured runs and judges them on others
(``docs/time-model.md``); the model's measured error gives the interval the planner prints.

Calibration: :func:`calibrate` takes a measured step (a smoke run's median) and returns a :class:`TimeModel`
whose ``scale`` reproduces it; with a second measured step with far fewer tokens it also solves for a fixed
``overhead_seconds`` per step (Python, data loading, synchronisation). A calibrated model's interval is the
smaller one measured for a calibration on the same GPU.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from lora_kit.memory.cuda_kernels import ENABLE_GQA_FROM, flash_attention_dtype, sdpa_backend, sdpa_call
from lora_kit.memory.device import torch_version as installed_torch_version
from lora_kit.memory.specs import ModelSpec, check_targets, model_spec
from lora_kit.plan import time_constants as C
from lora_kit.plan.gpus import compute_capability
from lora_kit.settings import DTYPE_BYTES, Step, as_step

PARTS = ("matmul", "adapters", "attention", "elementwise", "dequant", "lm_head_loss", "host_wait", "optimizer")


@dataclass(frozen=True)
class TimeModel:
    """The fitted constants (:mod:`lora_kit.plan.time_constants`), a calibration ``scale`` and fixed
    ``overhead_seconds``, and the model's measured ``error_factor`` (the interval is ``[t / f, t * f]``)."""
    matmul_efficiency: float = C.FITTED["matmul_efficiency"]
    attention_efficiency: float = C.FITTED["attention_efficiency"]
    bandwidth_efficiency: float = C.FITTED["bandwidth_efficiency"]
    host_seconds_per_kernel: float = C.FITTED["host_seconds_per_kernel"]
    dequant_factor: float = C.FITTED["dequant_factor"]
    l2_speedup: float = C.FITTED["l2_speedup"]
    scale: float = 1.0  # measured / modelled, from a calibration on the user's GPU
    overhead_seconds: float = 0.0  # fixed cost per step; 0 unless calibrated on 2 runs
    error_factor: float = C.ERROR_FACTOR_UNCALIBRATED
    source: str = ("fitted on published GPU runs (benchmarks/time_published.py, docs/time-model.md); calibrate "
                   "with a measured step on your GPU")
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency", "dequant_factor", "scale",
                     "l2_speedup"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v and math.isfinite(v)):
                raise ValueError(f"TimeModel.{name} must be a positive number, got {v!r}.")
        for name in ("overhead_seconds", "host_seconds_per_kernel"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"TimeModel.{name} must be >= 0, got {v!r}.")
        if not (isinstance(self.error_factor, (int, float)) and self.error_factor >= 1):
            raise ValueError(f"TimeModel.error_factor must be >= 1, got {self.error_factor!r}.")

    def describe(self) -> str:
        cal = f", x{self.scale:.3g} from calibration" if self.scale != 1 else ""
        fixed = f", {self.overhead_seconds:.3g} s fixed per step" if self.overhead_seconds else ""
        return (f"step-time model: matmuls at {self.matmul_efficiency:.0%} of their dtype's peak, attention at "
                f"{self.attention_efficiency:.0%}, memory traffic at {self.bandwidth_efficiency:.0%} of datasheet "
                f"bandwidth, {self.host_seconds_per_kernel * 1e6:.3g} us of host dispatch per kernel, bitsandbytes "
                f"dequantisation {self.dequant_factor:.3g}x its bandwidth bound, L2-resident traffic at "
                f"{self.l2_speedup:.3g}x DRAM bandwidth, non-reentrant checkpointing's "
                f"recompute waits for {recompute_host_calls('lora'):.3g} host dispatches per kernel (LoRA){cal}{fixed}; measured error within "
                f"x{self.error_factor:.2f} ({self.source})")  # as the card and the table print it

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


def _targets(spec, step: Step) -> list:
    """The adapted linears, checked by the one model check (as ``estimate`` does); on a mixture-of-experts model
    without the linears peft moves to the experts (``lora_kit.memory.moe.expert_lora``'s ``dropped``)."""
    from lora_kit.memory.moe import expert_lora
    names = check_targets(spec, "lora", step.lora_rank, step.lora_targets, "eager")  # attention is not checked here
    dropped = set(expert_lora(spec, names)["dropped"]) if spec.moe else set()
    return [lin for lin in spec.linears if lin.name in names and lin.name not in dropped]


def flops_per_step(spec, step: Step | None = None, **overrides) -> dict:
    """FLOPs of one step on one GPU, by part (see the module docstring for each formula); the step is ``step``
    (default ``PLANNING``) with ``overrides``."""
    spec, st = model_spec(spec), as_step(step, **overrides)
    seq_len, T = int(st.seq_len), int(st.batch_size) * int(st.seq_len)  # Python ints: exact at any size
    p_lin = sum(lin.in_features * lin.out_features * (lin.layers or spec.num_layers) for lin in spec.linears)
    if spec.moe:  # the parameters a token runs through: its k experts and the router, per expert block
        m = spec.moe
        i = m["expert_intermediate_size"]
        p_lin += len(m["moe_layers"]) * (m["experts_per_token"] * 3 * spec.hidden_size * i
                                         + spec.hidden_size * m["experts"])
    p_head = spec.vocab_size * spec.hidden_size
    causal = 0.5 if st.attn_implementation in ("sdpa", "flash_attention_2") else 1.0
    attn = 4.0 * T * seq_len * spec.num_heads * spec.head_dim * spec.num_layers * causal
    fwd_blocks = 2.0 * T * p_lin + attn
    fwd_head = 2.0 * T * p_head
    if st.method == "full":
        adapters = 0.0
        bwd = 2 * (fwd_blocks + fwd_head)
        recompute_adapters = 0.0
    else:
        ad = sum(st.lora_rank * (lin.in_features + lin.out_features) * (lin.layers or spec.num_layers)
                 for lin in _targets(spec, st))
        adapters = 6.0 * T * ad
        recompute_adapters = 2.0 * T * ad
        bwd = 2.0 * T * (p_lin + p_head) + 2 * attn
    parts = {"forward": fwd_blocks + fwd_head, "backward": bwd, "adapters": adapters,
             "recompute": (fwd_blocks + recompute_adapters) if st.gradient_checkpointing else 0.0}
    parts["total"] = sum(parts.values())
    parts["attention"] = attn * (3 + (1 if st.gradient_checkpointing else 0))  # included above; shown for reference
    parts["tokens"] = T
    return parts


def trainable_params(spec, step: Step) -> int:
    spec = model_spec(spec)
    if step.method == "full":
        return spec.num_params
    return sum(step.lora_rank * (lin.in_features + lin.out_features) for lin in _targets(spec, step)) * spec.num_layers


def l2_bytes(gpu: dict) -> float:
    """The GPU's L2 cache in bytes: the row's ``l2_mb``, else the datasheet figure in ``time_constants``; 0 when
    unknown (no L2 effect)."""
    own = gpu.get("l2_mb")
    if isinstance(own, (int, float)) and own == own and own > 0:
        return float(own) * 2 ** 20
    return C.L2_MB.get(gpu.get("name"), 0) * 2 ** 20


def fp32_flops(gpu: dict) -> tuple[float, str]:
    """FP32 CUDA-core FLOP/s of ``gpu`` and where the figure comes from."""
    own = gpu.get("fp32_tflops")
    if isinstance(own, (int, float)) and own == own and own > 0:
        return float(own) * 1e12, "the GPU row's fp32_tflops"
    if gpu.get("name") in C.FP32_TFLOPS:
        return C.FP32_TFLOPS[gpu["name"]] * 1e12, "datasheet FP32 (lora_kit/plan/time_constants.py)"
    return peak_flops(gpu, "bfloat16", False) * C.FP32_OF_BF16_FALLBACK, (
        f"assumed {C.FP32_OF_BF16_FALLBACK:.3g} of the bf16 peak (no FP32 figure for this GPU)")


def peak_flops(gpu: dict, dtype: str, autocast: bool) -> float:
    """Dense FLOP/s of ``gpu`` (a catalog row) for matmuls in ``dtype``: the tensor-core figure for bf16 / fp16
    (fp16's where bf16 is missing) and under autocast; CUDA cores (:func:`fp32_flops`) for fp32. A card without bf16
    (the T4) is thus timed at its fp16 figure for a bf16 step it cannot run: :func:`lora_kit.plan.gpus.gpu_problems`
    says so, and ``compare_methods`` gives such a row no time."""
    bf16, fp16 = gpu.get("bf16_tflops"), gpu.get("fp16_tflops")
    bf16 = bf16 if bf16 == bf16 and bf16 else fp16  # NaN / missing -> fp16 figure
    fp16 = fp16 if fp16 == fp16 and fp16 else bf16
    if not bf16 or bf16 != bf16:
        raise ValueError(f"GPU {gpu.get('name')!r} has no tensor-core TFLOP/s in the catalog; add bf16_tflops.")
    if dtype == "float32" and not autocast:
        return fp32_flops(gpu)[0]
    return float(fp16 if dtype == "float16" else bf16) * 1e12


KERNEL_OF_BACKEND = {"flash": "flash", "cudnn": "flash", "efficient": "mem_efficient", "math": "math"}  # cuDNN:
# a fused 16-bit kernel that keeps what flash keeps, timed as flash


def attention_kernel(spec, step: Step, gpu: dict, torch_version: tuple | None = None) -> str:
    """The kernel CUDA's SDPA runs for this step: "flash", "mem_efficient", "math", or "eager" (transformers'
    own matmul-softmax-matmul). What SDPA receives (dtype: fp32 under QLoRA's recipe, 16-bit under autocast;
    ``enable_gqa`` or K/V repeated by transformers; a mask) and the backend PyTorch's dispatch picks for it are
    :func:`lora_kit.memory.cuda_kernels.sdpa_call` and :func:`~lora_kit.memory.cuda_kernels.sdpa_backend`."""
    spec, st = model_spec(spec), as_step(step)
    if st.attn_implementation == "eager":
        return "eager"
    if st.attn_implementation == "flash_attention_2":  # flash-attn itself: no SDPA dispatch, no fallback
        return "flash"
    tv = installed_torch_version() if torch_version is None else tuple(torch_version)
    call = sdpa_call(spec, st)
    if call.enable_gqa and tv < ENABLE_GQA_FROM:  # transformers' use_gqa_in_sdpa needs torch 2.5: it repeats K/V
        call = replace(call, enable_gqa=False, kv_heads=call.q_heads)
    return KERNEL_OF_BACKEND[sdpa_backend(call, tv, compute_capability(gpu, unknown=8.0)).backend]


class _Clock:
    """Sums kernels by part. A kernel's device time is its roofline (at least ``C.KERNEL_MIN_SECONDS``); the host
    dispatches a pass's kernels while the device runs the ones already queued, so a pass takes
    ``max(device seconds, host seconds)`` and the host-bound excess is the part ``host_wait``."""

    def __init__(self, gpu: dict, tm: TimeModel):
        self.tm, self.gpu = tm, gpu
        self.bw = float(gpu["memory_bandwidth_gbs"]) * 1e9 * tm.bandwidth_efficiency
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.kernels = 0.0
        self.l2 = l2_bytes(gpu)
        self._mark = (0.0, 0.0)
        # what the kernels do, apart from how long they take: FLOPs by the dtype class they run at ("float32" on
        # CUDA cores, "16-bit" on tensor cores) and bytes of the kernels without FLOPs, by part (what
        # benchmarks/time_counts.py sets beside a real step's operators)
        self.f32_peak = fp32_flops(gpu)[0]
        self.flops, self.bytes, self.stage = {}, {}, "forward"

    def _bw(self, working_set):
        """Element-wise kernels read what the previous kernel just wrote: a working set that fits in L2 moves at
        ``l2_speedup`` times DRAM bandwidth; a larger one streams through it (LRU evicts a tensor's start before
        the next kernel reads it back), at DRAM bandwidth."""
        if not working_set or not self.l2 or working_set > self.l2:
            return self.bw
        return self.bw * self.tm.l2_speedup

    def add(self, part, flops=0.0, peak=1.0, eff=None, bytes_=0.0, kernels=1.0, times=1.0, working_set=None,
            fp32=None):
        dev = max(flops / (peak * (eff or self.tm.matmul_efficiency)), bytes_ / self._bw(working_set))
        if flops:
            key = f'{part}/{"float32" if (peak == self.f32_peak if fp32 is None else fp32) else "16-bit"}'
            self.flops[key] = self.flops.get(key, 0.0) + times * flops
        elif bytes_:
            key = f"{self.stage}/{part}"
            self.bytes[key] = self.bytes.get(key, 0.0) + times * bytes_
        self.seconds[part] += times * max(dev, kernels * C.KERNEL_MIN_SECONDS)
        self.kernels += times * kernels

    def matmul(self, part, T, k, n, peak, act_bytes, weight_bytes, times=1.0):
        """A ``T x k`` by ``k x n`` matmul; its output tiles run in waves over the SMs, the last one partly idle."""
        sms = C.SM_COUNT.get(self.gpu.get("name"))
        waves = math.ceil(T / C.GEMM_TILE) * math.ceil(n / C.GEMM_TILE) / sms if sms else 0
        filled = waves / math.ceil(waves) if waves else 1.0
        self.add(part, 2.0 * T * k * n, peak * filled, bytes_=T * (k + n) * act_bytes + k * n * weight_bytes,
                 times=times, fp32=peak == self.f32_peak)

    def device_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k != "host_wait")

    def begin_pass(self):
        self._mark = (self.device_seconds(), self.kernels)

    def end_pass(self, extra_host_per_kernel: float = 0.0, extra_kernels: float = 0.0):
        """Close a pass: the host spends ``host_seconds_per_kernel`` on each kernel it dispatched (Python and
        dispatcher); the device waits for it where the pass's kernels finish sooner. ``extra_host_per_kernel`` on
        ``extra_kernels`` (checkpointing's recompute) is host time the device always waits for."""
        dev = self.device_seconds() - self._mark[0]
        host = (self.kernels - self._mark[1]) * self.tm.host_seconds_per_kernel
        self.seconds["host_wait"] += max(0.0, host - dev) + extra_kernels * extra_host_per_kernel


def _adapter_bytes(k: int, n: int, ax: int, ro: int, aw: int, autocast: bool, bnb: bool,
                   backward: bool = False, x_grad: bool = True) -> float:
    """Bytes per token one LoRA-adapted linear's element-wise kernels move in forward (peft 0.21), the matmuls
    aside. ``ax``: bytes of an element of the input x; ``ro``: of the base layer's output; ``aw``: of the
    adapter weights (fp32: peft's ``autocast_adapter_dtype``). ``tuners/lora/layer.py`` ``Linear.forward``: x cast
    to the adapter dtype, ``lora_B(lora_A(x)) * scaling`` added to the result, the sum cast back to the result's
    dtype. ``tuners/lora/bnb.py`` ``Linear4bit.forward`` (``bnb``): the result cloned, and under CUDA's autocast
    neither the input nor the output cast (``requires_conversion = not torch.is_autocast_enabled()``). Under
    autocast, ``lora_A`` casts its fp32 input to 16-bit and ``lora_B`` returns 16-bit. Counted operator by operator
    against a real step (``benchmarks/time_counts.py``)."""
    half = 2
    convert = not (bnb and autocast)
    xa = aw if convert else ax  # the dtype lora_A receives
    b = k * (ax + aw) if convert and ax != aw else 0  # x.to(lora_A.weight.dtype)
    if autocast and xa != half:
        b += k * (xa + half)  # autocast's cast of lora_A's input
    if backward and not x_grad:  # an input that needs no gradient: neither cast runs backward
        b = 0
    lo = half if autocast else aw  # lora_B's output
    b += 2 * n * lo  # * scaling
    if backward:  # each cast's gradient cast back, the scaling's gradient, the sum's gradient cast to each input's
        # dtype (the autograd engine's), and x's gradient added to the base layer's (a clone's gradient is free)
        out = max(ro, lo)
        if bnb and convert and lo != ro:
            b += n * (lo + ro)  # output.to(expected_dtype)'s gradient
            lo = ro
        elif not bnb and out != ro:
            b += n * (out + ro)  # result.to(torch_result_dtype)'s gradient
        b += (n * (out + ro) if out != ro else 0) + (n * (out + lo) if out != lo else 0)
        return b + (3 * k * ax if x_grad else 0)
    if bnb:
        b += 2 * n * ro  # result.clone()
        if convert and lo != ro:
            b, lo = b + n * (lo + ro), ro  # output.to(expected_dtype)
        return b + n * (ro + lo + max(ro, lo))  # result + output
    out = max(ro, lo)
    b += n * (ro + lo + out)  # result + lora_B(...) * scaling
    return b + (n * (out + ro) if out != ro else 0)  # result.to(torch_result_dtype)


def _last_saving_linear(spec):
    """The block's last linear, where non-reentrant checkpointing's recompute stops, or None where the kit does
    not know the block's last operator (mixture-of-experts: the experts come after the linears of the spec).

    The recompute ends as soon as it has re-saved every tensor the block saved (early stop), and autograd saves a
    matmul's inputs before it runs the matmul: the block's last matmul that saves an input never runs again
    (full fine-tuning, and LoRA's frozen base: the MLP's output projection, ``down_proj`` or GPT-NeoX's
    ``dense_4h_to_h``; an adapted one: its ``lora_B``). Not where a norm follows the MLP (Gemma 2/3, OLMo 2): it
    saves that projection's output, so the recompute runs it. bitsandbytes' 4-bit matmul saves after it computes
    (``MatMul4Bit.forward``), so it runs."""
    last = spec.linears[-1] if spec.linears else None
    if spec.post_mlp_norm:  # a norm on the MLP's output saves it: the recompute runs down_proj to re-save it
        return None
    return last if last is not None and last.kind == "mlp_out" and not last.layers else None


def _block_pass(c: _Clock, spec, st: Step, gpu: dict, kind: str, T: int, times: float, adapted: set, kernel: str,
                recompute: bool = False):
    """One pass over the decoder blocks: ``kind`` = "forward" or "backward"; ``recompute``: checkpointing's
    forward again, inside backward (it stops at :func:`_last_saving_linear`)."""
    dt = st.part_dtypes
    a = DTYPE_BYTES[dt["activations"]]
    a_s = DTYPE_BYTES[dt["stream"]]
    mm_b = DTYPE_BYTES[dt["base"]]
    stop = _last_saving_linear(spec) if recompute else None
    base_peak = peak_flops(gpu, dt["base"], False)
    f32_peak = fp32_flops(gpu)[0]
    bwd = kind == "backward"
    L = spec.num_layers
    H, F = spec.hidden_size, spec.intermediate_size
    trained_base = st.method == "full"
    a_attn = DTYPE_BYTES[_attention_dtypes(spec, st, kernel)[1]]
    for lin in spec.linears:
        n_l = times * (lin.layers or L)
        k, n = lin.in_features, lin.out_features
        xa = a_attn if lin.kind == "attn_out" else a  # the linear's input: the attention output's dtype or the stream's
        # no input gradient into the first block, whose input needs none without checkpointing's
        # enable_input_require_grads when the embeddings are frozen
        first_free = bwd and st.method != "full" and not st.gradient_checkpointing and lin.kind == "attn_in"
        if not bwd:
            if not (lin is stop and lin.name not in adapted and st.method != "qlora"):
                c.matmul("matmul", T, k, n, base_peak, mm_b, mm_b, times=n_l)
        else:  # the input gradient (T x k out); with full fine-tuning the weight gradient (k x n out)
            c.matmul("matmul", T, n, k, base_peak, mm_b, mm_b, times=n_l - (times if first_free else 0))
            if trained_base:
                c.matmul("matmul", k, T, n, base_peak, mm_b, mm_b, times=n_l)
        if st.autocast and dt["weights"] == "float32":  # fp32 master weight cast to 16-bit per use
            c.add("elementwise", bytes_=k * n * 6, times=n_l)
        if st.method == "qlora":
            c.add("dequant", bytes_=k * n * (C.NF4_READ_BYTES + C.DEQUANT_WRITE_BYTES) * c.tm.dequant_factor,
                  kernels=2, times=n_l)
            if xa != mm_b:  # Linear4bit casts its input to the compute dtype and its output back (a no-op without
                # prepare_model_for_kbit_training's fp32 stream: qlora_prepare "none")
                c.add("elementwise", bytes_=T * (k + n) * (xa + mm_b), kernels=C.QLORA_EXTRA_KERNELS - 2, times=n_l,
                      working_set=T * max(k, n) * (xa + mm_b))
        if lin.name in adapted:
            r, ab = st.lora_rank, DTYPE_BYTES[dt["adapters"]]
            ap = f32_peak if dt["adapters"] == "float32" else peak_flops(gpu, dt["adapters"], False)
            per = 2 if bwd else 1  # A and B: input and weight gradients in backward
            c.matmul("adapters", T, k, r, ap, ab, ab, times=n_l * per - (times if first_free else 0))
            if st.lora_dropout > 0:  # peft's nn.Dropout on x cast to lora_A's dtype: reads it, writes the dropped
                # copy and a bool mask; backward (where x takes a gradient) reads the gradient and the mask, writes one
                xd = xa if st.method == "qlora" and st.autocast else DTYPE_BYTES[dt["adapter_weights"]]
                c.add("adapters", bytes_=T * k * (2 * xd + 1), kernels=1, times=n_l - (times if bwd and first_free
                                                                                         else 0))
            if lin is stop:  # the recompute stops before lora_B: only x's casts ran
                aw = DTYPE_BYTES[dt["adapter_weights"]]
                ew = T * k * (a + aw) if a != aw else 0
                c.add("adapters", bytes_=ew, kernels=1, times=n_l)
                continue
            c.matmul("adapters", T, r, n, ap, ab, ab, times=n_l * per)
            ro = xa if st.method == "qlora" else mm_b  # Linear4bit returns its input's dtype
            args = (k, n, xa, ro, DTYPE_BYTES[dt["adapter_weights"]], st.autocast, st.method == "qlora", bwd)
            per_token = _adapter_bytes(*args)
            ew = T * per_token
            if first_free:  # one block of n_l without x's gradient
                ew -= T * (per_token - _adapter_bytes(*args, x_grad=False)) * times / n_l
            c.add("adapters", bytes_=ew, working_set=T * n * (ab + a),
                  kernels=C.LORA_ELEMENTWISE_KERNELS * (C.BACKWARD_KERNELS if bwd else 1), times=n_l)
    # element-wise traffic of one block
    q_k = T * (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    layout = 0 if kernel in ("flash", "mem_efficient") else C.ATTN_LAYOUT_PASSES
    # under autocast the rotary tables are in the stream's dtype, which q and k take on (promotion)
    a_rot = max(a, a_s) if st.autocast else a
    norm_bytes, norm_kernels = _norm(spec)
    rot = spec.rotary_fraction
    ew = (spec.norms_per_layer * T * H * norm_bytes(a_s)
          + q_k * ((C.ROTARY_FP32_BYTES(a_rot) if spec.rotary_fp32 else C.ROTARY_PASSES * a_rot) * rot
                   + (a_rot * C.PARTIAL_ROTARY_PASSES if rot < 1 else 0))
          + (q_k * norm_bytes(a) if spec.qk_norms else 0)  # RMSNorm on every head of q and k
          + T * H * (a * layout + 2 * a_s * C.RESIDUAL_PASSES)
          + T * _dense_ffn(spec) * a * (C.MLP_ACT_PASSES if spec.gated_mlp else C.PLAIN_MLP_ACT_PASSES))
    if st.autocast:
        if st.method != "qlora" and a_s != mm_b:  # each linear fed by the stream casts it (activations: no cache)
            ew += T * sum(lin.in_features for lin in spec.linears if lin.kind in ("attn_in", "mlp_in")) * (a_s + mm_b)
        if a_rot != mm_b and st.attn_implementation == "sdpa":  # SDPA's q/k (and v) cast to 16-bit
            v_el = T * spec.num_kv_heads * spec.head_dim
            ew += q_k * (a_rot + mm_b) + (v_el * (a + mm_b) if a != mm_b else 0)
    kn = (spec.norms_per_layer * norm_kernels
          + (2 * norm_kernels if spec.qk_norms else 0) + C.ROTARY_KERNELS + C.BLOCK_OTHER_KERNELS)
    c.add("elementwise", bytes_=ew * (C.BACKWARD_ELEMENTWISE if bwd else 1), working_set=T * max(H, F) * 2 * a,
          kernels=kn * (C.BACKWARD_KERNELS if bwd else 1), times=times * L)
    _attention(c, spec, st, gpu, kernel, bwd, times * L)
    if spec.moe:
        _experts(c, spec, st, gpu, bwd, T, times, recompute)


def _experts(c: _Clock, spec, st: Step, gpu: dict, bwd: bool, T: int, times: float, recompute: bool = False):
    """The routed experts of each mixture-of-experts block, as transformers 5.24 runs them
    (``experts_implementation="grouped_mm"``, :mod:`lora_kit.memory.moe`): the router's matmul and top-k, the
    ``S = T * k`` (token, expert) rows gathered, one grouped matmul for gate and up, the activation, one for
    down, the routing weights (fp32) applied and the rows summed back per token. FLOPs do not depend on the
    routing (every token runs ``k`` experts). Backward: the input gradients; full fine-tuning also the experts'
    weight gradients. LoRA on the experts (peft's ``ParamWrapper``: "all-linear" on Mixtral-like models)
    materializes ``W + B @ A`` for every expert stack in each forward (``baddbmm``) and takes the stack's weight
    gradient in backward to reach A and B. Shared experts are ordinary linears of the spec. Under QLoRA's
    recipe the experts are not quantized and stay fp32 (CUDA cores)."""
    from lora_kit.memory.moe import expert_lora
    m = spec.moe
    E, k, i, n = m["experts"], m["experts_per_token"], m["expert_intermediate_size"], times * len(m["moe_layers"])
    h, S = spec.hidden_size, T * k
    dt = st.part_dtypes
    a = DTYPE_BYTES[dt["activations"]]
    xp = "float32" if st.method == "qlora" and st.kbit_prepared and not st.autocast else dt["base"]
    xb, peak = DTYPE_BYTES[xp], peak_flops(gpu, xp, False)
    lora = expert_lora(spec, check_targets(spec, "lora", st.lora_rank, st.lora_targets, "eager")) \
        if st.method != "full" else {}
    trained = st.method == "full" or lora.get("gate_up") or lora.get("down")
    r = st.lora_rank
    c.matmul("matmul", T, h, E, peak, xb, xb, times=n * (1 + bwd))  # the router (and its input gradient)
    for kk, nn in ((h, 2 * i), (i, h)):  # gate_up, down: (S, K) x (E, K, N)
        if not bwd:
            c.matmul("matmul", S, kk, nn, peak, xb, xb, times=n)
        else:
            c.matmul("matmul", S, nn, kk, peak, xb, xb, times=n)  # the input gradient
            if trained:  # the stack's weight gradient: full fine-tuning, or LoRA's way to A and B
                c.matmul("matmul", kk, S, nn, peak, xb, xb, times=n)
    for role, kk, nn, rank in (("gate_up", h, 2 * i, 2 * r), ("down", i, h, r)):
        if lora.get(role):  # W + B @ A per expert stack (baddbmm: W read, W' written), twice per forward as peft
            # 0.21.2 runs it (counted: benchmarks/time_counts.py); backward: A's and B's gradients (two bmm
            # through the stack's gradient)
            c.add("adapters", flops=2.0 * E * nn * rank * kk, peak=peak, bytes_=2 * E * nn * kk * xb, kernels=1,
                  times=2 * n)
            # the factors A (E r x K) and B (N x E r) cast from the adapters' dtype to the stack's for it
            # (``ParamWrapper.get_delta_factors``)
            c.add("adapters", bytes_=E * r * (kk + nn) * (DTYPE_BYTES[dt["adapters"]] + xb), kernels=2, times=2 * n)
    if lora.get("router"):  # the router's W + B @ A (E x h, in the adapters' dtype), materialized the same way
        ap = fp32_flops(gpu)[0] if dt["adapters"] == "float32" else peak_flops(gpu, dt["adapters"], False)
        c.add("adapters", flops=2.0 * E * r * h, peak=ap, bytes_=2 * E * h * 4, kernels=1, times=2 * n)
    # (transformers 5.24 ``integrations/moe.py`` ``grouped_mm_experts_forward``) the rows gathered (the hidden state
    # read, S x h written), the activation and product (S x i); then the routing weights applied (fp32 weights: an
    # fp32 product), the rows put back in order (an fp32 S x h index), summed per token in fp32 and cast back.
    # Checkpointing's recompute stops before the last four (early stop).
    tail = 0 if recompute else S * h * (a + 4) + 2 * S * h * 4 + (S * h + T * h) * 4 + T * h * (4 + a)
    ew = T * h * a + S * h * a + 5 * S * i * a + tail + T * E * 4 * 6 + S * 8 * 6
    c.add("elementwise", bytes_=ew * (C.BACKWARD_ELEMENTWISE if bwd else 1), kernels=12 * (C.BACKWARD_KERNELS if bwd else 1),
          times=n, working_set=S * max(h, 2 * i) * a)


def _attention_dtypes(spec, st: Step, kernel: str) -> tuple[str, str]:
    """The dtype attention's q/k/v arrive in and the one its kernel runs in (and returns, the attention output
    projection's input): SDPA's by its call (QLoRA's recipe: fp32; CUDA's autocast casts SDPA's inputs to 16-bit),
    FlashAttention-2's after transformers' casts of what the projections made (autocast casts nothing on the way
    in), eager's matmuls under autocast in 16-bit."""
    if st.attn_implementation == "flash_attention_2":
        return st.activation_dtype, flash_attention_dtype(st)
    if kernel == "eager":
        dt = st.part_dtypes
        return dt["activations"], (dt["base"] if st.autocast else dt["activations"])
    act = sdpa_call(spec, st).dtype
    return act, act


def _attention(c: _Clock, spec, st: Step, gpu: dict, kernel: str, bwd: bool, times: float):
    B, s = st.batch_size, st.seq_len
    width = spec.num_heads * spec.head_dim
    act, run = _attention_dtypes(spec, st, kernel)  # q/k/v as they arrive; the dtype the kernel computes in
    if st.attn_implementation == "flash_attention_2" and act != run:  # fa_peft_integration_check's casts of q/k/v
        # (forward), their gradients' casts back (backward)
        qkv = B * s * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        c.add("attention", bytes_=qkv * (DTYPE_BYTES[act] + DTYPE_BYTES[run]), kernels=3, times=times)
    if kernel in ("flash", "mem_efficient"):
        flops = 4.0 * B * s * s * width * C.CAUSAL_FRACTION * (C.FLASH_BACKWARD_FLOPS if bwd else 1.0)
        peak = peak_flops(gpu, run, False)  # fp32: CUDA cores
        c.add("attention", flops, peak, eff=c.tm.attention_efficiency,
              bytes_=4 * B * s * width * DTYPE_BYTES[run], kernels=3 if bwd else 1, times=times)
        return
    # math / eager: full S x S scores materialised (the causal half is masked, not skipped); eager's K/V repeated
    # per query head in the dtype they arrive in, its matmuls in 16-bit under autocast
    peak = peak_flops(gpu, run, False)
    score_b = 4 if kernel == "eager" or run == "float32" else DTYPE_BYTES[run]
    passes = C.MATH_SCORE_PASSES_BWD if bwd else C.MATH_SCORE_PASSES_FWD
    scores = B * spec.num_heads * s * s * score_b * passes
    gqa = 2 * B * s * width * DTYPE_BYTES[act] * 2 if spec.num_kv_heads != spec.num_heads else 0
    c.add("attention", 4.0 * B * s * s * width * (2 if bwd else 1), peak, bytes_=0, kernels=2 * (2 if bwd else 1),
          times=times)
    c.add("attention", bytes_=scores + gqa, kernels=passes, times=times)


def device_parts(spec, gpu: dict, step: Step | None = None, time_model: TimeModel | None = None,
                 reentrant_checkpointing: bool = False, **overrides) -> dict:
    """Seconds of one optimizer step by part (before calibration), kernels launched, the attention kernel.
    ``reentrant_checkpointing``: the checkpointing flavour of code that calls ``torch.utils.checkpoint`` itself
    with ``use_reentrant=True`` (PyTorch's choice when the caller passes none, in 2023 code such as Qwen-1's
    ``modeling_qwen.py``; transformers 5 passes ``use_reentrant=False``): its recompute is a
    plain forward, without the non-reentrant flavour's saved-tensor hooks (the kit's loop and the HF Trainer's
    ``gradient_checkpointing_kwargs={"use_reentrant": False}`` are non-reentrant)."""
    tm = time_model or TimeModel()
    spec, st = model_spec(spec), as_step(step, **overrides)
    c = _Clock(gpu, tm)
    T = int(st.batch_size) * int(st.seq_len)
    adapted = set() if st.method == "full" else {lin.name for lin in _targets(spec, st)}
    kernel = attention_kernel(spec, st, gpu)
    dt = st.part_dtypes
    hb = DTYPE_BYTES[dt["head"]]
    hp = peak_flops(gpu, dt["head"], False)
    H, V = spec.hidden_size, spec.vocab_size
    a_s = DTYPE_BYTES[dt["stream"]]
    norm_bytes, norm_kernels = _norm(spec)  # the final norm, the blocks' kind
    c.begin_pass()  # forward: the blocks, the final norm, lm_head and the loss
    _block_pass(c, spec, st, gpu, "forward", T, 1.0, adapted, kernel)
    # autocast casts an fp32 lm_head weight to 16-bit per use (QLoRA's recipe; full fine-tuning's master weights)
    head_cast = V * H * 6 if st.autocast and (st.kbit_prepared or dt["weights"] == "float32") else 0
    if st.liger_kernel:
        _liger_loss_head(c, st, T, H, V, hp, hb, head_cast, 2 * T * H * norm_bytes(a_s), norm_kernels)
    else:
        c.matmul("lm_head_loss", T, H, V, hp, hb, hb)
        c.add("lm_head_loss", bytes_=head_cast, kernels=1 if head_cast else 0)
        cast = C.LOSS_CAST_BYTES if hb != 4 else 0  # 16-bit logits: .float() (and the gradient's cast back)
        c.add("lm_head_loss", bytes_=T * V * (4 * C.LOSS_PASSES_FWD + cast) + T * H * norm_bytes(a_s),
              kernels=6 + norm_kernels)
    c.end_pass()
    c.begin_pass()  # backward: lm_head's gradients, then the blocks' (after each block's recompute when checkpointing)
    c.stage = "backward"
    if not st.liger_kernel:  # Liger's fused cross-entropy computed them in forward
        c.add("lm_head_loss", bytes_=T * V * (4 * C.LOSS_PASSES_BWD + cast)
              + T * H * norm_bytes(a_s) * C.BACKWARD_ELEMENTWISE, kernels=6 + norm_kernels)
        c.matmul("lm_head_loss", T, V, H, hp, hb, hb)  # the input gradient (T x H out)
        if st.method == "full":
            c.matmul("lm_head_loss", H, T, V, hp, hb, hb)  # the weight gradient (H x V out)
            # its 16-bit gradient cast back to the fp32 master weight's dtype (autocast); the embedding's
            # gradient, a dense V x H table written per micro-step (embedding_dense_backward)
            c.add("lm_head_loss", bytes_=head_cast + V * H * DTYPE_BYTES[dt["weights"]],
                  kernels=2 if head_cast else 1)
    before = c.kernels
    if st.gradient_checkpointing:  # the blocks' forward again, inside backward (its Python re-runs too)
        c.stage = "recompute"  # reentrant checkpointing reruns the whole forward (no early stop)
        _block_pass(c, spec, st, gpu, "forward", T, 1.0, adapted, kernel, recompute=not reentrant_checkpointing)
    recomputed = c.kernels - before
    c.stage = "backward"
    _block_pass(c, spec, st, gpu, "backward", T, 1.0, adapted, kernel)
    stall = tm.host_seconds_per_kernel * recompute_host_calls(st.method)  # the device waits (module docstring)
    c.end_pass(0.0 if reentrant_checkpointing else stall, recomputed)
    micro = sum(c.seconds.values())
    opt_s, opt_k = _optimizer_seconds(spec, st, c)
    parts = {k: v * st.grad_accum for k, v in c.seconds.items()}
    parts["optimizer"] = opt_s
    counts = {"flops": dict(c.flops), "bytes": dict(c.bytes)}  # one micro-step: "part/dtype", "stage/part"
    return {"parts": parts, "micro_step_seconds": micro, "kernels": c.kernels * st.grad_accum + opt_k,
            "counts": counts,
            "attention_kernel": kernel, "dtypes": dt, "fp32_source": fp32_flops(gpu)[1]}


def _liger_loss_head(c: _Clock, st: Step, T: int, H: int, V: int, hp: float, hb: int, head_cast: float,
                     norm_bytes: float, norm_kernels: int) -> None:
    """Liger's fused linear cross-entropy (liger-kernel 0.6.4 ``ops/fused_linear_cross_entropy.py``
    ``fused_linear_cross_entropy_forward``), all in forward: per chunk of ``chunk_tokens`` rows the logits' matmul,
    ``liger_cross_entropy_kernel`` over them in their dtype (``ops/cross_entropy.py``: an online-softmax pass that
    reads them, a gradient pass that reads and writes them: :data:`C.LIGER_LOSS_PASSES`), the input gradient's
    matmul copied into its slice, and with full fine-tuning the weight gradient's matmul, cast to fp32 and added.
    The same matmuls as the unfused head, the backward's moved into forward; none in backward (the saved gradients
    are returned, scaled in place when the loss was scaled)."""
    from lora_kit.memory.liger import chunk_tokens
    rows = chunk_tokens(T, H, V)
    n = math.ceil(T / rows)
    full = st.method == "full"
    c.matmul("lm_head_loss", rows, H, V, hp, hb, hb, times=n)  # logits_chunk = _input_chunk @ weight.t()
    c.matmul("lm_head_loss", rows, V, H, hp, hb, hb, times=n)  # grad_input[start:end] = grad_logits_chunk @ weight
    if full:
        c.matmul("lm_head_loss", H, rows, V, hp, hb, hb, times=n)  # torch.mm(grad_logits_chunk.t(), _input_chunk)
    # the cross-entropy kernel and the grad_input slice copy; full: .float() of the V x H product (none when it is
    # fp32 already) and grad_weight += it (grad_weight in the weight's dtype)
    cast = V * H * (hb + 4) if full and hb != 4 else 0
    add = V * H * (hb + 4 + hb) if full else 0
    per_chunk = rows * V * hb * C.LIGER_LOSS_PASSES + 2 * rows * H * hb + cast + add
    c.add("lm_head_loss", bytes_=n * per_chunk + norm_bytes + head_cast,
          kernels=n * (2 + (1 if cast else 0) + (1 if full else 0)) + 2 * norm_kernels + (1 if head_cast else 0))


def _dense_ffn(spec: ModelSpec) -> float:
    """The width of the MLP activation a block runs outside routed experts: the intermediate size, or in a
    mixture-of-experts model the dense MLPs and shared experts that are linears of the spec (each MLP's last
    projection takes its width), averaged over the blocks; the routed experts' activation is :func:`_experts`'."""
    if not spec.moe:
        return spec.intermediate_size
    L = spec.num_layers
    return sum(lin.in_features * (lin.layers or L) for lin in spec.linears if lin.kind == "mlp_out") / L


def _norm(spec: ModelSpec) -> tuple:
    """The bytes per element (a function of the activation's bytes) and kernels of the model's norm: LayerNorm
    with bias (GPT-NeoX), RMSNorm, or RMSNorm weighted in fp32 (Gemma, OLMo 2), in the blocks, on q and k and
    before ``lm_head`` alike."""
    if spec.norm_bias:
        return C.LAYER_NORM_BYTES, C.LAYER_NORM_KERNELS
    return (C.UPCAST_NORM_BYTES if spec.norm_upcast else C.NORM_BYTES), C.NORM_KERNELS


def recompute_host_calls(method: str) -> float:
    """Host dispatches the device waits for per kernel that non-reentrant checkpointing recomputes: the kernel
    again, and checkpoint.py's three Python hook calls per saved tensor (``time_constants``)."""
    return 1 + C.CHECKPOINT_HOOK_CALLS * C.SAVED_TENSORS_PER_KERNEL.get(method, 1.0)


def _optimizer_seconds(spec, st: Step, c: _Clock) -> tuple:
    n = trainable_params(spec, st)
    if st.method == "full":
        elem = 4 if (st.autocast or st.dtype == "float32") else DTYPE_BYTES[st.dtype]
        tensors = len(spec.linears) * spec.num_layers + spec.norms_per_layer * spec.num_layers + 3
    else:
        elem, tensors = 4, 2 * len(_targets(spec, st)) * spec.num_layers
    per = C.OPTIMIZER_BYTES_PER_PARAM.get(st.optimizer, C.ADAMW_FOREACH_PASSES * elem)
    kernels = C.FOREACH_OPS * math.ceil(tensors / C.FOREACH_TENSORS_PER_KERNEL)
    dev = n * per / c.bw
    return max(dev, kernels * c.tm.host_seconds_per_kernel), kernels


def step_time(spec, gpu: dict, step: Step | None = None, time_model: TimeModel | None = None,
              reentrant_checkpointing: bool = False, **overrides) -> dict:
    """Predicted seconds per optimizer step on each GPU (``grad_accum`` micro-steps of ``batch_size`` rows, then
    the optimizer) and tokens/s over all GPUs, for ``step`` (default ``PLANNING``) with ``overrides``.

    ``gpu`` is a catalog row (``lora_kit.plan.gpus.get_gpu(name)``) or any dict with ``bf16_tflops`` /
    ``fp16_tflops`` and ``memory_bandwidth_gbs`` (optionally ``fp32_tflops`` and ``compute_capability``).
    ``interval_seconds`` is ``[t / f, t * f]`` with ``f`` the model's measured error (``time_model.error_factor``).
    """
    tm = time_model or TimeModel()
    spec, st = model_spec(spec), as_step(step, **overrides)
    d = device_parts(spec, gpu, st, tm, reentrant_checkpointing)
    p = d["parts"]
    modelled = sum(p.values())
    total = tm.scale * modelled + tm.overhead_seconds
    f = flops_per_step(spec, st)
    tokens = f["tokens"] * st.grad_accum
    flops = f["total"] * st.grad_accum
    peak = peak_flops(gpu, st.part_dtypes["base"], False)
    return {"step_seconds": total, "interval_seconds": (total / tm.error_factor, total * tm.error_factor),
            "compute_seconds": tm.scale * (p["matmul"] + p["adapters"] + p["attention"] + p["lm_head_loss"]),
            "dequant_seconds": tm.scale * p["dequant"], "optimizer_seconds": tm.scale * p["optimizer"],
            "parts_seconds": {k: tm.scale * v for k, v in p.items()}, "kernels": d["kernels"],
            "attention_kernel": d["attention_kernel"], "dtypes": d["dtypes"], "flops": flops,
            "tokens_per_step": tokens * st.num_gpus, "tokens_per_second": tokens * st.num_gpus / total,
            "mfu": flops / (total * peak), "time_model": tm.describe()}


def calibrate(measured_step_seconds: float, settings, gpu: dict, time_model: TimeModel | None = None,
              spec=None, second: tuple | None = None) -> TimeModel:
    """A TimeModel whose ``scale`` reproduces ``measured_step_seconds`` for ``settings`` on ``gpu``.

    ``settings``: a :class:`lora_kit.settings.Settings`, or a dict of step fields and ``model``.
    ``second=(seconds, settings)``: a second measured step with far fewer tokens (e.g. batch 1 and a short
    sequence). Then two numbers are solved for: ``scale`` and a fixed ``overhead_seconds`` per step (Python,
    data loading, synchronisation), which dominates small models and CPUs. The calibrated model's
    ``error_factor`` is the smaller one measured after calibrating on the same GPU
    (``time_constants.ERROR_FACTOR_CALIBRATED``).
    """
    for t in (measured_step_seconds, *(second[:1] if second else ())):
        if not (isinstance(t, (int, float)) and t > 0 and math.isfinite(t)):
            raise ValueError(f"measured step seconds must be positive numbers, got {t!r}.")
    tm = replace(time_model or TimeModel(), scale=1.0, overhead_seconds=0.0)

    def modelled(sett):
        model = spec if spec is not None else (sett["model"] if isinstance(sett, dict) else sett.model)
        st = as_step(sett)
        return step_time(model, gpu, st, time_model=tm)["step_seconds"], st.to_dict()

    a1, kw = modelled(settings)
    label = f"{kw.get('method')}, seq_len {kw.get('seq_len')}, batch {kw.get('batch_size')}"
    err = max(1.0, min(tm.error_factor, C.ERROR_FACTOR_CALIBRATED))
    if second is not None:
        a2, kw2 = modelled(second[1])
        if a1 == a2:
            raise ValueError("the two calibration runs need different token counts (seq_len x batch_size).")
        scale = (measured_step_seconds - second[0]) / (a1 - a2)
        overhead = measured_step_seconds - a1 * scale
        if scale > 0 and overhead >= 0:
            return replace(tm, scale=scale, overhead_seconds=overhead, error_factor=err, source=(
                f"calibrated on two measured steps: {measured_step_seconds:.4g} s ({label}) and {second[0]:.4g} s "
                f"({kw2.get('method')}, seq_len {kw2.get('seq_len')}, batch {kw2.get('batch_size')})"))
        # inconsistent pair (noise): fall back to the one-run calibration below
    return replace(tm, scale=measured_step_seconds / a1, overhead_seconds=0.0, error_factor=err,
                   source=f"calibrated on a measured step of {measured_step_seconds:.4g} s ({label})")
