"""Memory estimate of one training step: ``simulate`` in closed form, microseconds, vectorizable.

``simulate`` is the model; this module evaluates its fitted envelope and holds no architecture of its own.
For the model and the step's categorical settings a fit of ``simulate`` is looked up (shipped with the package,
or in the user's cache: :mod:`lora_kit.memory.fits`), else made on the spot from shallow, short ``simulate`` runs
(``$LORA_KIT_FIT=auto``, the default; ``never`` raises instead, naming the command that fits). The figure is that
fit evaluated (:mod:`lora_kit.memory.calibrate`: exact integer polynomials in tokens, micro-batch and rank, blocks
added per layer type), and ``memory_model`` says "fitted". FSDP2's own step (``fsdp`` / ``zero3`` with LoRA or
full fine-tuning, AdamW or SGD, no offload, no experts) is fitted per GPU count from ``simulate``'s sharded runs;
``zero3`` adds DeepSpeed's reduce bucket to it. A step ``simulate`` cannot run, or that differs from a fit only in
its static parts -- another optimizer whose step composes, ZeRO-1/2, ZeRO-3 / FSDP with QLoRA, offload or other
optimizers, DDP's buckets -- is a one-GPU fit composed with the exact static arithmetic of weights, quantisation
constants, adapters, gradients and optimizer states (:mod:`lora_kit.memory.compose`, :mod:`lora_kit.memory.static`;
full fine-tuning only from a fit that extrapolates each operator in depth), and ``memory_model`` says "composed
(...)", naming what was composed.

What is counted is defined in ``design.md`` ("one training step" = the second step of a loop; peak = max bytes of
live tensors, each storage rounded up to 512 bytes, counting everything already live); ``breakdown`` is the
composition at the peak (it sums to ``peak_allocated_bytes``) and ``phase`` names the phase holding it.
``device_total_bytes`` is what the process adds to the card (:mod:`lora_kit.memory.device`): the CUDA context,
torch's reserved memory, the memory outside the allocator, and NCCL's buffers per rank on several GPUs. Paged
optimizer states are shown apart ("resident when room"), never in a fit verdict.

Known limits are ``simulate``'s (its docstring): the CPU kernels (``lora_kit.memory.cuda_kernels`` says where CUDA
picks others), no kernel workspaces or communication buffers in the allocated figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from lora_kit.memory import fits
from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.calibrate import largest_phase
from lora_kit.memory.compose import DEEPSPEED, GRADIENTS_SHARDED, SWAPPABLE, compose, deepspeed_bucket_bytes, label, \
    static_terms
from lora_kit.memory.device import device_kwargs, device_total
from lora_kit.memory.moe import expert_lora
from lora_kit.memory.specs import ModelSpec, check_attention, check_targets, model_spec
from lora_kit.memory.static import trainable_tensors as _trainable_tensors
from lora_kit.settings import Step, as_step, check_axes

PHASES = ("forward", "backward", "optimizer")


@dataclass
class Estimate:
    """Result of :func:`estimate` (the same shape as ``simulate``'s result)."""
    peak_allocated_bytes: int
    device_total_bytes: int
    breakdown: dict
    phase: str
    settings: dict = field(default_factory=dict)
    memory_model: str = ""  # "fitted" (the closed form of simulate; with the libraries it was fitted with when they
    # differ from the installed ones) or "arithmetic (not fitted)"

    def cuda_allocated_bytes(self, compute_capability=None) -> int:
        """What ``torch.cuda.max_memory_allocated()`` will read on a GPU of ``compute_capability`` (e.g. 9.0, the
        catalog's column; None: a card with the larger, 32 MiB, cuBLAS workspace): the peak plus two cuBLAS
        workspaces (:func:`lora_kit.memory.device.cuda_allocated_bytes`)."""
        from lora_kit.memory.device import cuda_allocated_bytes
        return cuda_allocated_bytes(self.peak_allocated_bytes, compute_capability)

    def to_dict(self) -> dict:
        return {"peak_allocated_bytes": self.peak_allocated_bytes, "device_total_bytes": self.device_total_bytes,
                "breakdown": dict(self.breakdown), "phase": self.phase, "settings": dict(self.settings),
                "memory_model": self.memory_model}




def estimate_arrays(spec, step: Step | None = None, **fields) -> dict:
    """Vectorized core of :func:`estimate` (the planner's engine).

    ``step``: the step (:data:`lora_kit.settings.PLANNING` when None); ``fields``: step fields changed from it,
    each a scalar, or for an integer field (``seq_len``, ``batch_size``, ``lora_rank``, ``num_gpus`` ...) an
    array: a sweep axis, numpy-broadcastable with the others and validated with the step
    (:func:`lora_kit.settings.check_axes`). Returns every ``breakdown`` key plus ``peak_allocated_bytes`` and
    ``device_total_bytes`` as integer arrays (int64, or Python ints where a figure passes int64's room), ``phase``
    as an array of phase names and ``memory_model`` as an array of labels. Raises ValueError when no fit can be
    had: ``$LORA_KIT_FIT=never`` and none stored, or a setting the fit cannot describe (it says which).
    """
    spec = model_spec(spec)
    axes = {k: v for k, v in fields.items() if np.ndim(v) > 0}
    s = as_step(step, **{k: v for k, v in fields.items() if k not in axes})
    ax = check_axes(s, **axes)
    seq_len, batch_size, lora_rank, num_gpus = (ax.get(k, getattr(s, k)) for k in ("seq_len", "batch_size", "lora_rank",
                                                                                    "num_gpus"))
    targets, experts = _trained_targets(spec, s, lora_rank)
    check_attention(s)
    S, B, r, N = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (seq_len, batch_size, lora_rank,
                                                                               num_gpus)))
    gpus = np.unique(N)
    if _fsdp_groups(spec, s) and gpus.size > 1:  # FSDP2's step is fitted per GPU count: one count at a time
        parts = [estimate_arrays(spec, s, seq_len=S[N == n], batch_size=B[N == n], lora_rank=r[N == n],
                                 num_gpus=np.full(int((N == n).sum()), n)) for n in gpus]
        out = {}
        for k in parts[0]:
            kind = object if any(p[k].dtype == object for p in parts) else parts[0][k].dtype
            out[k] = np.empty(S.shape, dtype=kind if k != "phase" else object)
            for n, p in zip(gpus, parts):
                out[k][N == n] = p[k]
        out["phase"] = out["phase"].astype(str)
        return out
    s_fit = s.replace(num_gpus=int(gpus[0])) if _fsdp_groups(spec, s) else s
    if spec.num_layers < (3 if _fsdp_groups(spec, s) else 2):  # shallower than the stacks a fit runs: simulate it
        return _simulated_arrays(spec, s, S, B, r, N, f"{spec.num_layers} layers, fewer than a fit's stacks")
    try:
        fitted = _fit_for(spec, s_fit)
        if _gap(spec, fitted[0], S) and (spec, s_fit) not in _REFITTED:  # an older design's fit: refitted, once
            _REFITTED.add((spec, s_fit))
            fitted = _fit_now(spec, s_fit if _fsdp_groups(spec, s) else s_fit.one_gpu().replace(optimizer=fitted[2]))
            fits._MEMO[_fit_memo(spec, s_fit)] = fitted
        gap = _gap(spec, fitted[0], S)
    except Unfittable as e:
        return _simulated_arrays(spec, s, S, B, r, N, str(e))
    if gap:  # lengths or a depth the fit does not describe (a model shallower than its stacks): simulate them
        return _simulated_arrays(spec, s, S, B, r, N, gap)
    return _fitted_arrays(spec, s, targets, experts, fitted, S, B, r, N)


class Unfittable(ValueError):
    """The step's operators cannot be fitted in closed form (``lora_kit.memory.calibrate.fit`` says why)."""


def _simulated_arrays(spec: ModelSpec, s: Step, S, B, r, N, why: str) -> dict:
    """No closed form for this step (``why``): ``simulate`` itself, once per distinct row (exact, seconds each);
    only for what ``simulate`` runs (one GPU, DDP, FSDP2's own step), not for a composed setting."""
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.specs import load_config
    if s.sharding not in ("none", "ddp") and not _fsdp_groups(spec, s) or s.cpu_offload:
        raise ValueError(f"{spec.name}: this step has no closed form ({why}), and {s.sharding} with these "
                         "settings is composed from one, which simulate cannot run: plan it on one GPU.")
    flat = [tuple(int(x) for x in row) for row in zip(S.ravel(), B.ravel(), r.ravel(), N.ravel())]
    step = json.dumps([spec.config, s.to_dict()], sort_keys=True, default=str)
    for row in dict.fromkeys(flat):
        if (step, row) not in _SIMULATED:  # each distinct row once per process
            _SIMULATED[(step, row)] = simulate(load_config(spec.config), s, seq_len=row[0], batch_size=row[1],
                                               lora_rank=row[2], num_gpus=row[3])
    pick = [_SIMULATED[(step, row)] for row in flat]
    out = {k: np.asarray([p.breakdown[k] for p in pick], dtype=object).reshape(S.shape) for k in BREAKDOWN_KEYS}
    for k in ("peak_allocated_bytes", "device_total_bytes"):
        out[k] = np.asarray([getattr(p, k) for p in pick], dtype=object).reshape(S.shape)
    out["phase"] = np.asarray([p.phase for p in pick]).reshape(S.shape)
    out["memory_model"] = np.full(S.shape, f"simulated (no closed form: {why})", dtype=object)
    return out


def _gap(spec: ModelSpec, f, S) -> str | None:
    """What of the sweep's lengths or the model's depth the fit does not describe (None: it describes them all)."""
    if not f.covers(S):
        return "; ".join(f.unfitted.values()) or "lengths below every fitted regime"
    if f.weights(spec.num_layers, _filled_layer_types(spec)) is None:
        return f"the fit does not describe {spec.num_layers} layers of this pattern"
    return None


def _fit_memo(spec: ModelSpec, s: Step) -> tuple:
    """Where :func:`_fit_for` keeps its answer: in the lookups' memo (cleared with it), per user cache."""
    return ("fit_for", str(fits.user_dir()), spec, s)


def _fit_for(spec: ModelSpec, s: Step):
    """(fit, what it was fitted with, the optimizer it was fitted with) for this model and step: the step's own fit,
    else the same step's fit with AdamW (another optimizer is composed: :mod:`lora_kit.memory.compose`), else one
    fitted now (:func:`_fit_now`).

    Full fine-tuning is composed only from a fit whose operators are extrapolated one by one in depth
    (``Fit.aligned``): an older fit extrapolates each shallow stack's largest operator, and the end of backward
    (every gradient made) is outgrown at two or three blocks but can hold the peak at full depth once the states are
    small (Phi-4-mini, full, SGD, 2,048 tokens: the stacks' largest operators extrapolated were 26.7 % below
    ``simulate``)."""
    if not spec.config:
        raise ValueError(f"{spec.name}: no config to fit its memory model from; pass a config.json or a model folder.")
    memo = _fit_memo(spec, s)
    if memo not in fits._MEMO:
        fits._MEMO[memo] = _find_fit(spec, s)
    return fits._MEMO[memo]


def _find_fit(spec: ModelSpec, s: Step, make: bool = True):
    """:func:`_fit_for`, uncached; ``make=False``: None where no fit is kept (nothing is fitted)."""
    if _fsdp_groups(spec, s):  # FSDP2's own step at this GPU count, fitted as simulate runs it
        found = fits.lookup(spec.config, s)
        return (*found, s.optimizer) if found else _fit_now(spec, s) if make else None
    one = s.one_gpu()  # one GPU's step: sharding is composed
    for opt in dict.fromkeys((s.optimizer, "adamw") if s.optimizer in SWAPPABLE else (s.optimizer,)):
        found = fits.lookup(spec.config, one.replace(optimizer=opt))
        composed = opt != s.optimizer or s.sharding not in ("none", "ddp")
        if found is not None and (s.method != "full" or not composed or found[0].aligned):
            return (*found, opt)
    return _fit_now(spec, one) if make else None


def has_fit(model, step: Step | None = None, **overrides) -> bool:
    """True when :func:`estimate` answers ``model`` and the step from a fit already kept (shipped or in the user's
    cache), False when it would fit one first (seconds to minutes): a caller that needs one figure can then
    :func:`lora_kit.memory.simulate.simulate` it, the same number, for the cost of one simulated step."""
    spec, s = model_spec(model), as_step(step, **overrides)
    if not spec.config:
        return False
    return _fit_memo(spec, s) in fits._MEMO or _find_fit(spec, s, make=False) is not None


def _fit_now(spec: ModelSpec, s: Step):
    """A fit of ``s`` made now and kept in the user's cache (a progress bar on a terminal), unless
    ``$LORA_KIT_FIT=never``: then a ValueError naming the command that makes it."""
    import sys

    if not fits.should_fit():
        raise fits.MissingFit(f"No memory fit of {spec.name} for these settings is stored and LORA_KIT_FIT=never. "
                              f"`lora-kit fit --model {spec.name} {fits.describe(s)}` makes it (seconds to a "
                              "minute), or unset LORA_KIT_FIT to fit on the spot.")
    key = fits.digest(fits.key(spec.config, s))
    if key not in _UNFITTABLE:
        title, bar = f"fitting the memory model of {spec.name}", sys.stderr.isatty()
        if not bar:  # a log, a notebook, a batch job: one line instead of a bar
            print(f"lora_kit: {title} for these settings (once; then cached in {fits.user_dir()}, which "
                  "LORA_KIT_FITS moves): seconds to a few minutes on a CPU", file=sys.stderr, flush=True)
        try:
            return (*fits.make(spec.config, s, show=title if bar else None), s.optimizer)
        except ValueError as e:  # calibrate.fit refuses what it cannot align or fit exactly, saying why
            _UNFITTABLE[key] = str(e)
    raise Unfittable(_UNFITTABLE[key])


_UNFITTABLE: dict = {}  # fit key -> why it cannot be fitted (tried once per process)
_SIMULATED: dict = {}  # (model and step, row) -> simulate's result, for steps without a closed form
_REFITTED: set = set()  # (model, step) whose stored fit did not describe the asked lengths: refitted in this process


def _trained_targets(spec: ModelSpec, s: Step, lora_rank) -> tuple[tuple, dict]:
    """The LoRA targets peft trains (checked) and :func:`lora_kit.memory.moe.expert_lora` of them: on MoE experts,
    what peft trains there; the linears it drops are taken out of the targets."""
    targets = check_targets(spec, s.method, lora_rank, s.lora_targets, s.attn_implementation)
    experts = expert_lora(spec, targets)
    return tuple(t for t in targets if t not in experts["dropped"]), experts


def _fsdp_groups(spec: ModelSpec, s: Step) -> bool:
    """Whether FSDP2's per-rank figure is FSDP2's own step (fitted per GPU count: ``simulate`` runs it, and a
    one-GPU fit composed with sharded gradients missed its validation rows by up to 1.9 %), not composed."""
    from lora_kit.memory.calibrate import fsdp_step
    return fsdp_step(s) and not spec.moe


def _filled_layer_types(spec: ModelSpec):
    """The layer types transformers fills in for the config (what a fit's depth composition reads)."""
    return fits.layer_types(spec.config)


@lru_cache(maxsize=256)
def _one_row_terms(spec: ModelSpec, s: Step, targets: tuple, experts: tuple, fitted_optimizer: str, r: int, N: int,
                   kind) -> dict:
    """:func:`lora_kit.memory.compose.static_terms` of one row (a single estimate), cached; ``experts``: the
    ``expert_lora`` flags as sorted items."""
    tensors, _ = _trainable_tensors(spec, s, targets, dict(experts), np.asarray([r], dtype=kind))
    return static_terms(spec, s, fitted_optimizer, tensors, np.asarray([N], dtype=kind))


def _fitted_arrays(spec: ModelSpec, s: Step, targets: tuple, experts: dict, fitted, S, B, r, N) -> dict:
    """:func:`estimate_arrays` from a fit, composed with the static arithmetic where the step differs from it
    (:mod:`lora_kit.memory.compose`): exact integers (int64 arrays, or Python ints where a figure passes int64's
    room); ``memory_model`` says which, and with which libraries when they differ from today's."""
    f, info, fitted_optimizer = fitted
    args = (spec.num_layers, B.ravel(), S.ravel(), r.ravel(), _filled_layer_types(spec))
    phases = f.phase_arrays(*args)
    kind = next(iter(phases.values()))[1].dtype
    sharded = _fsdp_groups(spec, s)  # FSDP2's own step: nothing to compose (zero3: DeepSpeed's bucket, below)
    if not sharded and (s.optimizer != fitted_optimizer or s.sharding != "none" or np.any(N > 1)):
        if r.size == 1:  # one figure: the static terms of this step, rank and GPU count, computed once
            terms = _one_row_terms(spec, s, targets, tuple(sorted(experts.items())), fitted_optimizer,
                                   int(r.ravel()[0]), int(N.ravel()[0]), kind)
        else:
            tensors, _ = _trainable_tensors(spec, s, targets, experts, r.ravel().astype(kind))
            terms = static_terms(spec, s, fitted_optimizer, tensors, N.ravel().astype(kind))
        phases = compose(s, phases, terms)
    if s.sharding in GRADIENTS_SHARDED and not sharded:  # the one-GPU peak's operator, or the one largest with 1/N
        other = compose(s, f.phase_arrays(*args, N.ravel()), terms)
        phases = {ph: (np.maximum(p, other[ph][0]), np.where((other[ph][0] > p)[:, None], other[ph][1], q))
                  for ph, (p, q) in phases.items()}
    peak, parts, phase = largest_phase({ph: phases[ph] for ph in PHASES if ph in phases})
    out = {k: parts[:, i] for i, k in enumerate(BREAKDOWN_KEYS[:5])}
    if sharded and s.sharding in DEEPSPEED:  # the engine ZeRO-3 launches: its reduce bucket, kept from backward on
        bucket = deepspeed_bucket_bytes(s.dtype)
        peak, out["gradients"] = peak + bucket, out["gradients"] + bucket
    out["activations"] = peak - sum(out[k] for k in BREAKDOWN_KEYS[:5])
    out = {k: np.asarray(v, dtype=kind).reshape(S.shape) for k, v in out.items()}
    out["peak_allocated_bytes"] = np.asarray(peak, dtype=kind).reshape(S.shape)
    out["device_total_bytes"] = np.asarray(device_total(out["peak_allocated_bytes"], **device_kwargs(
        spec, s, (S * B).astype(kind), N.astype(kind))), dtype=kind)
    out["phase"] = phase.astype(str).reshape(S.shape)
    note = fits.version_note(info)
    how = label(s, fitted_optimizer) if not sharded else "fitted" if s.sharding == "fsdp" else \
        "composed (DeepSpeed's reduce bucket by arithmetic on FSDP2's fitted step)"
    out["memory_model"] = np.full(S.shape, how + (f" ({note})" if note else ""), dtype=object)
    return out


def estimate(model="tiny", step: Step | None = None, **overrides) -> Estimate:
    """Peak GPU memory of one training step, per GPU, by arithmetic (see the module docstring).

    ``model``: catalog name, "tiny", local folder / config.json, hub id (online) or PretrainedConfig.
    ``step``: a :class:`lora_kit.settings.Step` (default: ``PLANNING``, a real model on a GPU: bf16, 2048
    tokens, micro-batch 1, gradient checkpointing on); ``overrides``: step fields changed from it, e.g.
    ``estimate("llama-3.1-8b", method="qlora", seq_len=4096)``. ``grad_accum`` and ``lora_alpha`` do not
    change the peak. Raises ValueError saying what to change for bad input.
    """
    s = as_step(step, **overrides)
    spec = model_spec(model)
    arrays = estimate_arrays(spec, s)
    return Estimate(peak_allocated_bytes=int(arrays["peak_allocated_bytes"]),
                    device_total_bytes=int(arrays["device_total_bytes"]),
                    breakdown={k: int(arrays[k]) for k in BREAKDOWN_KEYS}, phase=str(arrays["phase"]),
                    memory_model=str(arrays["memory_model"]),
                    settings={"model": model if isinstance(model, str) else getattr(model, "name_or_path", repr(model)),
                              **s.to_dict()})


def paged_resident(model="tiny", step: Step | None = None, **overrides) -> int:
    """Bytes a paged bitsandbytes optimizer (``paged_adamw_8bit`` / ``paged_adamw_32bit``) keeps in CUDA managed
    memory per GPU for ``step`` (as :func:`estimate` takes it): ``state1`` / ``state2`` of every trainable tensor of
    100,000 elements or more (:func:`lora_kit.memory.device.paged_resident_bytes`; 32-bit states are fp32 whatever
    the tensor's dtype). Outside ``max_memory_allocated`` and the device total; nvidia-smi shows them while there is
    room. Where optimizer states are sharded (``zero1``-``zero3``, ``fsdp``) each of ``num_gpus`` ranks holds its
    share (the 100,000-element rule applied to whole tensors, not to a rank's shard). 0 for other optimizers."""
    from lora_kit.memory.compose import STATES_SHARDED
    from lora_kit.memory.device import paged_resident_bytes
    s = as_step(step, **overrides)
    if not s.optimizer.startswith("paged_"):
        return 0
    spec = model_spec(model)
    targets, experts = _trained_targets(spec, s, s.lora_rank)
    tensors, _ = _trainable_tensors(spec, s, targets, experts, np.asarray([s.lora_rank], dtype=np.int64))
    total = int(np.asarray(paged_resident_bytes(s.optimizer, tensors)).sum())
    return -(-total // s.num_gpus) if s.sharding in STATES_SHARDED and s.num_gpus > 1 else total
