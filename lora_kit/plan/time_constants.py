"""Every constant of the step-time model (:mod:`lora_kit.plan.timing`), each with its source.

Two kinds:

- **Counted** from the code CUDA runs (PyTorch, transformers, peft, bitsandbytes): bytes a kernel moves, kernels
  an op launches, which attention kernel SDPA picks. Not fitted.
- **Fitted** (``FITTED``): a few numbers, the same for every GPU, fitted by ``benchmarks/time_published.py`` on the
  calibration rows of ``benchmarks/reference/time_rows.json`` and judged on the rest (``docs/time-model.md``).
  A GPU enters only through its datasheet peaks (``lora_kit/catalog/gpus.csv``: ``bf16_tflops``,
  ``fp16_tflops``, ``memory_bandwidth_gbs``; FP32 below).
"""
from __future__ import annotations

# --- fitted (benchmarks/time_published.py from its fixed START; results in benchmarks/results/time_published.json)
FITTED = {
    "matmul_efficiency": 0.87,  # fraction of the dtype's dense peak a large matmul reaches (fit bounded by 0.87: MAMF)
    "attention_efficiency": 0.73,  # fraction of the 16-bit tensor peak FlashAttention / mem-efficient reach (<= 0.73)
    "bandwidth_efficiency": 0.598,  # fraction of datasheet bandwidth element-wise kernels reach
    # host (Python + dispatcher) seconds per kernel launched; a pass whose kernels finish sooner waits for it
    "host_seconds_per_kernel": 2.11e-05,
    # bitsandbytes NF4 dequantisation / its bandwidth bound (published measurements say 2-6x; only one QLoRA row is
    # fitted, so this one is loosely pinned: docs/time-model.md)
    "dequant_factor": 1.0,
    "l2_speedup": 2.24,  # L2 bandwidth / DRAM bandwidth for element-wise traffic that stays in L2
}

# Measured error of the model (benchmarks/results/time_published.json): the planner's interval is
# [t / factor, t * factor]. Before calibration: the largest miss over the in-scope rows and over each source
# predicted from the other sources' fit (a plan is made for a machine and software stack no row measured); after the smoke run's
# calibration on the rented GPU: the largest miss of a one-row calibration predicting another row of the same
# GPU, model, method and checkpointing (a smoke run measures the planned settings).
ERROR_FACTOR_UNCALIBRATED = 1.36  # fitted x1.18, judged x1.13, one source left out x1.36
ERROR_FACTOR_CALIBRATED = 1.21  # worst pair of the same model, method, checkpointing (median 6.3 %)

# --- non-reentrant checkpointing (torch.utils.checkpoint, use_reentrant=False; counted from its code, not fitted):
# a block is recomputed from inside backward when the autograd engine first unpacks one of its saved tensors, and
# the device waits for that host work. Per recomputed kernel the host dispatches the kernel again (1) and, for each
# tensor the block saves, runs three Python calls of checkpoint.py: _recomputation_hook.pack_hook (a
# torch._dynamo.disable'd function: dict and handle bookkeeping), _checkpoint_frame.check_recomputed_tensors_match
# (the determinism check re-reads every saved tensor's metadata) and _checkpoint_hook.unpack_hook; each call is
# timed as one dispatch (host_seconds_per_kernel). Reentrant checkpointing runs none of these hooks.
CHECKPOINT_HOOK_CALLS = 3
# saved tensors per dispatched op of one decoder block, counted with saved_tensors_hooks and a TorchDispatchMode
# around one LlamaDecoderLayer forward (transformers 5.24, peft 0.21, bf16): LoRA all-linear 57 saved / 80 ops,
# the bare block (full fine-tuning) 38 / 38. QLoRA is timed with LoRA's figure.
SAVED_TENSORS_PER_KERNEL = {"lora": 57 / 80, "qlora": 57 / 80, "full": 38 / 38}

# --- the shortest time a kernel occupies the GPU back to back (launch latency on the device side, a few us on
# every current NVIDIA GPU); the host's dispatch time per kernel is the fitted host_seconds_per_kernel
KERNEL_MIN_SECONDS = 2e-6

# --- FP32 (non-tensor, CUDA-core) dense TFLOP/s, vendor datasheets ------------------------------------------
# QLoRA's usual recipe (prepare_model_for_kbit_training) keeps LoRA layers, norms and lm_head in fp32, and
# torch.backends.cuda.matmul.allow_tf32 defaults to False (PyTorch >= 1.12), so those matmuls run on CUDA
# cores at this rate, not on tensor cores. Keys are catalog names; a row's own ``fp32_tflops`` wins.
FP32_TFLOPS = {
    "T4": 8.1,  # NVIDIA T4 datasheet
    "L4": 30.3,  # NVIDIA L4 datasheet
    "A10G": 31.2,  # NVIDIA A10 datasheet (the A10G's public figure is the A10's)
    "RTX-4090": 82.6,  # Ada whitepaper appendix
    "RTX-6000-Ada": 91.1,  # RTX 6000 Ada datasheet
    "L40S": 91.6,  # L40S datasheet
    "A100-40GB": 19.5, "A100-80GB": 19.5,  # A100 datasheet
    "H100-PCIe": 51.0, "H100-SXM": 67.0, "H200": 67.0,  # H100 / H200 datasheets
    "B200": 80.0,  # HGX B200 specifications (FP32 per GPU)
}
FP32_OF_BF16_FALLBACK = 1 / 8  # GPU without an FP32 figure: assumed 1/8 of its bf16 tensor peak (shown as assumed)

# --- streaming multiprocessors, vendor datasheets / architecture whitepapers: a matmul's output is computed in
# tiles, one tile per SM at a time; the last wave of tiles leaves SMs idle (NVIDIA "Matrix Multiplication
# Background User's Guide", wave quantization). GEMM_TILE: the output tile of cuBLAS's large bf16 kernels.
SM_COUNT = {"T4": 40, "L4": 58, "A10G": 80, "RTX-4090": 128, "RTX-6000-Ada": 142, "L40S": 142, "A100-40GB": 108,
            "A100-80GB": 108, "H100-PCIe": 114, "H100-SXM": 132, "H200": 132, "B200": 148}
GEMM_TILE = 128

# --- L2 cache (MB), vendor datasheets / architecture whitepapers ---------------------------------------------
# Element-wise kernels re-read tensors the previous kernel wrote: when they fit in L2 the traffic does not reach
# DRAM. Ada's large L2 (L40S, RTX cards) matters for short sequences.
L2_MB = {"T4": 4, "L4": 48, "A10G": 6, "RTX-4090": 72, "RTX-6000-Ada": 96, "L40S": 96, "A100-40GB": 40,
         "A100-80GB": 40, "H100-PCIe": 50, "H100-SXM": 50, "H200": 50, "B200": 126}

# --- attention kernel CUDA's SDPA picks: lora_kit.memory.cuda_kernels.sdpa_backend reads PyTorch's dispatch rules
# (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp select_sdp_backend), e.g. this one:
MEM_EFFICIENT_GQA_FROM_TORCH = (2, 14)  # memory-efficient kernel accepts enable_gqa from torch 2.14 (PR 191085)
CAUSAL_FRACTION = 0.5  # flash / memory-efficient kernels skip the masked half of a causal score matrix
FLASH_BACKWARD_FLOPS = 2.5  # FlashAttention-2 backward = 2.5x its forward FLOPs (5 matmuls vs 2; Dao 2023 §3)
MATH_SCORE_PASSES_FWD = 6  # math kernel, per S x S element: write QK^T, read+write mask add, read+write softmax, read for AV
MATH_SCORE_PASSES_BWD = 7  # grad of probs (write), softmax backward (read p, dp; write ds), ds read by two matmuls

# --- element-wise traffic per decoder block, forward (HF Llama-family modelling code; transformers 5.24) ------
# Counted operator by operator on a real step (benchmarks/time_counts.py: every operator's tensor bytes read and
# written, per element of the tensor it runs over, a = bytes of an activation element).
# RMSNorm: to(fp32) and to(dtype) (each a + 4; none when the stream is fp32), pow (8), mean (4), * rsqrt (8),
# weight * (2a):
NORM_BYTES = lambda a: 20 + 2 * a + (2 * (a + 4) if a != 4 else 0)  # noqa: E731
NORM_KERNELS = 7
# RMSNorm that multiplies by its weight in fp32 and casts last (Gemma, OLMo 2: ``(x * w).to(dtype)``): the weight
# multiply reads and writes fp32 (8) instead of the 16-bit stream (2a); the casts are the same
UPCAST_NORM_BYTES = lambda a: 28 + (2 * (a + 4) if a != 4 else 0)  # noqa: E731
# LayerNorm (GPT-NeoX): one fused kernel reads the row and writes it (its mean and rstd are per row)
LAYER_NORM_BYTES = lambda a: 2 * a  # noqa: E731
LAYER_NORM_KERNELS = 1
# q*cos and rotate_half(q)*sin (2a each), rotate_half's neg and cat (a + 4a, measured), the add (3a): per element
# of q and k
ROTARY_PASSES = 12
# fp32 cos and sin (OLMo 2): both products read q in a and write fp32 (a + 4 each), rotate_half stays in a (5a),
# the add runs in fp32 (12), the cast back reads fp32 and writes a (4 + a); the same as ROTARY_PASSES when a = 4
ROTARY_FP32_BYTES = lambda a: 8 * a + 24 if a != 4 else ROTARY_PASSES * 4  # noqa: E731
ROTARY_KERNELS = 12
RESIDUAL_PASSES = 3  # two reads, one write, per residual add (two adds per block)
MLP_ACT_PASSES = 5  # silu(gate) (read, write) then * up (two reads, one write): per ffn element
PLAIN_MLP_ACT_PASSES = 2  # an ungated MLP (GPT-NeoX's GELU): read, write
PARTIAL_ROTARY_PASSES = 2  # partial rotary (GPT-NeoX): cat(turned part, the rest) reads and writes each element
BLOCK_OTHER_KERNELS = 8  # reshapes that copy (transpose().contiguous()), residual adds, activation
# q/k/v/out to and from the heads layout: views for the fused kernels (flash, memory-efficient: they take strided
# q/k/v and write the output in the layout transpose(1, 2) makes contiguous); copies around the math kernel and
# eager attention (read + write of the hidden state, four times)
ATTN_LAYOUT_PASSES = 4
# backward bytes of the block's element-wise operators per forward byte: a gradient op reads the saved input(s)
# and the gradient and writes one or two gradients; measured on a real full fine-tuning step without
# checkpointing (benchmarks/time_counts.py: 2.2 with the embedding's gradient left out)
BACKWARD_ELEMENTWISE = 2.2
BACKWARD_KERNELS = 1.5  # backward kernels per forward kernel (element-wise grads fuse less than they launch)

# --- LoRA (peft tuners/lora/layer.py Linear.forward) --------------------------------------------------------
# x cast to the adapter dtype (fp32 by default: autocast_adapter_dtype=True), lora_A, lora_B, * scaling,
# result + ..., cast back: 2 matmuls and 3 element-wise kernels per adapted linear.
LORA_ELEMENTWISE_KERNELS = 3

# --- QLoRA (bitsandbytes Linear4bit / matmul_4bit) ----------------------------------------------------------
NF4_READ_BYTES = 0.5  # 4-bit weight read per element
DEQUANT_WRITE_BYTES = 2  # the compute-dtype (bf16) copy written per element, then read by the matmul
QLORA_EXTRA_KERNELS = 4  # dequantize (+ absmax dequant with double quant), cast in, cast out

# --- loss (transformers ForCausalLMLoss: logits.float(), shift, cross_entropy) ------------------------------
# fp32 passes over T x V (transformers 5 shifts the labels, not the logits): forward log_softmax (r+w) and nll (r);
# backward nll (zeros + scatter: w+w) and log_softmax's backward (r+r+w). Logits in 16-bit add the upcast
# (2 + 4 bytes) in forward and the gradient's cast back in backward.
LOSS_PASSES_FWD = 3
LOSS_PASSES_BWD = 5
LOSS_CAST_BYTES = 6
# Liger's fused linear cross-entropy (use_liger_kernel): liger-kernel 0.6.4 ops/cross_entropy.py
# liger_cross_entropy_kernel reads each row of the logits chunk twice (online softmax, then the gradient) and writes
# the gradient over it once, in the logits' dtype
LIGER_LOSS_PASSES = 3

# --- optimizer step (torch.optim.AdamW(foreach=True), _multi_tensor_adam) -----------------------------------
# One read or write of a state-sized tensor per foreach op: weight decay mul_ (2), lerp_ (3), mul_ (2),
# addcmul_ (3), sqrt (2), div_ (2), add_ eps (2), addcdiv_ (4) = 20 passes over trainable elements.
ADAMW_FOREACH_PASSES = 20
OPTIMIZER_BYTES_PER_PARAM = {"adamw_8bit": 10, "paged_adamw_8bit": 10,  # bitsandbytes fused 8-bit kernel:
                             "sgd": 8, "adafactor": 12}  # p, g read; 1-byte m, v rw; p write (bnb optim)
FOREACH_TENSORS_PER_KERNEL = 36  # tensors per foreach launch at depth 4 (ATen MultiTensorApply.cuh depth_to_max_tensors)
FOREACH_OPS = 10  # foreach launches per AdamW step (the 8 ops above + step count + bias corrections)
