"""Sharded training steps, per rank: the real FSDP2 engine on fake tensors (``simulate``) or on real ones.

``simulate(..., num_gpus=N, sharding="fsdp")`` lands here. The model is built exactly as
:mod:`lora_kit.memory.simulate` builds it (meta device, peft, fake parameters), then PyTorch's own
FSDP2 (``torch.distributed.fsdp.fully_shard``) shards it over a **fake process group** of world
size N (``torch.testing._internal.distributed.fake_pg``: collectives return at once, no data
moves, every buffer FSDP2 allocates for them is still allocated). Two real training steps run
(:func:`lora_kit.training.train_step`, the one step); the second is tracked on rank 0 with the
:class:`~lora_kit.memory.tracker.LiveBytesTracker`, which follows FSDP2's in-place storage
resizes (how it frees and re-allocates gathered parameters) and counts each ``DTensor`` by its
local shard. Rank 0 holds the largest shard (FSDP2 pads dim 0 to a multiple of N), so its peak is
the per-GPU figure to plan with.

The wrapping (:mod:`lora_kit.fsdp`) is what a user gets from accelerate's FSDP2: every decoder layer, the
input embedding, the tail [final norm, lm_head], then the root; see that module for the policies.

How each ``sharding`` value maps onto FSDP2, and what stays arithmetic:

- ``fsdp``, ``zero3``: ``fully_shard`` as above (parameters, gradients and optimizer states
  sharded; gathered per unit in forward and again in backward). DeepSpeed ZeRO-3 is not simulated:
  its buffers (gradient bucket, prefetch bucket, persistence threshold) differ, so ``zero3`` is FSDP2's
  figure (real DeepSpeed steps on CPU: ``benchmarks/deepspeed_accuracy.py``).
- ``zero2``: FSDP2's ZeRO-2-like mode, ``reshard_after_forward=False`` everywhere (parameters stay
  gathered from forward to backward; gradients and states sharded). DeepSpeed ZeRO-2 (what
  ``accelerate_config`` writes for zero2) also keeps the full parameters between steps; that
  difference is not simulated. This mode equals real FSDP2 ranks (torchrun, gloo) byte for byte on
  rank 0 (tiny model, fp32: LoRA N=2, full N=3; ``benchmarks/memory_accuracy.py --sharded --real``);
  ``estimate`` keeps its ZeRO arithmetic for zero2.
- ``zero1`` (states sharded only) has no FSDP2 counterpart: ``estimate``'s arithmetic.
- ``ddp``: not sharded; :mod:`lora_kit.memory.simulate` (one GPU's step + DDP's gradient buckets).
- ``cpu_offload=True``: FSDP2's ``CPUOffloadPolicy`` needs an accelerator device distinct from the
  host to show what stays on the GPU; with CPU-only fake tensors it cannot, so it is ``estimate``'s
  arithmetic.
- QLoRA + sharding: bitsandbytes' ``Params4bit`` is sharded by FSDP2 only with a floating
  ``bnb_4bit_quant_storage`` (accelerate otherwise leaves the 4-bit weights out of sharding); not
  attempted on fake tensors here, so it is ``estimate``'s arithmetic. Likewise the bitsandbytes
  optimizers and adafactor on sharded (``DTensor``) parameters: only ``adamw`` and ``sgd`` run.

Limits: the tracker sees tensors, not the CUDA caching allocator's per-stream pools (FSDP2 on CUDA
all-gathers on a separate stream and keeps a gathered buffer until the next all-gather is issued,
which the CPU run does too, in program order); NCCL's own buffers are not tensors and are not
counted.

The real side, :func:`measure_sharded`, is the same model and step on real tensors: run it under
``torchrun --nproc_per_node N -m lora_kit.memory.sharded --settings '{...}' --out peaks.json`` (gloo
on CPU); every rank measures its own peak with the same tracker.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from lora_kit.memory.breakdown import label_training_state, tracked_peak
from lora_kit.memory.tracker import LiveBytesTracker
from lora_kit.fsdp import POLICIES, shard_for_training
from lora_kit.training import train_step

def label_fsdp(tracker: LiveBytesTracker, net, optimizer=None) -> None:
    """:func:`label_training_state` plus FSDP2's gathered (unsharded) parameters, labelled as their shards."""
    from torch.distributed.fsdp import FSDPModule
    label_training_state(tracker, net, optimizer)
    for m in net.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in (group.fsdp_params if group is not None else ()):
            t = getattr(fp, "_unsharded_param", None)
            if t is not None:
                tracker.label([t], "adapters" if "lora_" in fp._param_fqn else "weights")


@contextlib.contextmanager
def counted_collectives():
    """Count the bytes FSDP2 all-gathers (output buffers) and reduce-scatters (input buffers) while active.

    FSDP2 calls ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` for every group; a ring
    all-gather or reduce-scatter sends and receives (N - 1) / N of that buffer per rank."""
    counts = {"all_gather_bytes": 0, "reduce_scatter_bytes": 0}
    ag, rs = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output, input, *a, **k):
        counts["all_gather_bytes"] += output.numel() * output.element_size()
        return ag(output, input, *a, **k)

    def reduce_scatter_single(output, input, *a, **k):
        counts["reduce_scatter_bytes"] += input.numel() * input.element_size()
        return rs(output, input, *a, **k)
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        yield counts
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = ag, rs


def tracked_sharded_step(net, optimizer, batch: dict, steps: int = 2, autocast_ctx=None, trace: bool = False):
    """Run ``steps`` training steps; track the last (everything already live counted). Returns the tracker;
    its ``collectives`` attribute holds the last step's all-gathered and reduce-scattered buffer bytes.
    ``trace``: keep the live bytes after each operator (``LiveBytesTracker(trace=True)``)."""
    for _ in range(steps - 1):
        train_step(net, batch, optimizer, autocast_ctx=autocast_ctx)
    tracker = LiveBytesTracker(trace=trace)
    label_fsdp(tracker, net, optimizer)
    tracker.track(v for v in batch.values() if isinstance(v, torch.Tensor))
    tracker.reset_peak()
    with tracker, counted_collectives() as counts:
        train_step(net, batch, optimizer, tracker=tracker, autocast_ctx=autocast_ctx,
                   on_grads=lambda: label_fsdp(tracker, net))
    tracker.collectives = counts
    return tracker


@contextlib.contextmanager
def fake_world(num_gpus: int):
    """A fake default process group of ``num_gpus`` ranks (this process is rank 0) and its 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("simulate(sharding='fsdp') needs its own (fake) process group, and one is already "
                           "initialized in this process; run simulate before init_process_group or in another process.")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=num_gpus)
    try:
        yield init_device_mesh("cpu", (num_gpus,))  # made outside FakeTensorMode (it reads real rank ids)
    finally:
        dist.destroy_process_group()


def check_simulable(s) -> None:
    """Refuse, saying what to use instead, the sharded settings FSDP2 on fake tensors cannot show."""
    if s.cpu_offload:
        raise ValueError("simulate cannot show what CPU offload leaves on the GPU (no device besides the host "
                         "here); use lora_kit.memory.estimate for cpu_offload=True.")
    if s.method == "qlora":
        raise ValueError("simulate cannot shard QLoRA (bitsandbytes 4-bit weights under FSDP2); use "
                         "lora_kit.memory.estimate for QLoRA with sharding (its one-GPU fit, qlora_prepare resolved, composed).")
    if s.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"simulate runs FSDP2 with torch / transformers optimizers; optimizer={s.optimizer!r} "
                         "on sharded DTensor parameters is not simulated: use optimizer='adamw' or "
                         "lora_kit.memory.estimate.")


def simulate_sharded(net, batch: dict, s, fake_mode, ctx, policy: str = "accelerate", trace: bool = False):
    """Rank 0's tracker for the steady-state step of the fake, adapted model ``net`` under FSDP2 over a
    fake world of ``s.num_gpus`` ranks (``batch``: fake tensors, per GPU); ``trace``: per operator, as
    ``simulate(trace=True)``."""
    from lora_kit.training import optimizer_for
    check_simulable(s)
    with fake_world(s.num_gpus) as mesh, fake_mode:
        shard_for_training(net, mesh, s, policy)
        opt = optimizer_for(net.parameters(), s.optimizer, device_type="cpu")
        return tracked_sharded_step(net, opt, batch, steps=2, autocast_ctx=ctx, trace=trace)


# -- the real side: one process per rank under torchrun -----------------------------------------
def measure_sharded(model, policy: str = "accelerate", seed: int = 0, steps: int = 2, **step) -> dict:
    """This rank's measured peak of a real FSDP2 step (call in every rank of an initialized process group).

    Same model, adapter, sharding and step as :func:`simulate_sharded`, on real random-init tensors on CPU.
    Returns ``{"rank", "peak_allocated_bytes", "breakdown", "phase", "wall_seconds", "collectives"}``."""
    from torch.distributed.device_mesh import init_device_mesh

    from lora_kit.memory.measure import build_real_model
    from lora_kit.memory.specs import check_model_step, load_config
    from lora_kit.training import autocast_context, optimizer_for
    from lora_kit.settings import as_step
    s = as_step(None, **step)
    check_model_step(model, s)
    check_simulable(s)
    cfg = load_config(model)
    net, _, batch = build_real_model(cfg, s.replace(optimizer="sgd"), seed=seed)  # optimizer rebuilt after sharding
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard_for_training(net, mesh, s, policy)
    opt = optimizer_for(net.parameters(), s.optimizer, device_type="cpu")
    t0 = time.perf_counter()
    tracker = tracked_sharded_step(net, opt, batch, steps=steps,
                                   autocast_ctx=autocast_context(s.autocast, s.dtype, "cpu"))
    peak, bd = tracked_peak(tracker)
    return {"rank": dist.get_rank(), "peak_allocated_bytes": peak, "breakdown": bd, "phase": tracker.peak_phase,
            "wall_seconds": time.perf_counter() - t0, "collectives": tracker.collectives}


def main(argv=None) -> None:
    """torchrun entry point: every rank measures each case; rank 0 writes all ranks' results to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", required=True,
                    help="JSON object (model and step settings, as for simulate; \"policy\" overrides --policy), "
                    "or a list of them (one launch)")
    ap.add_argument("--policy", default="accelerate", choices=POLICIES, help="FSDP2 wrapping (lora_kit.fsdp)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    settings = json.loads(a.settings)
    cases = settings if isinstance(settings, list) else [settings]
    dist.init_process_group("gloo")
    try:
        results = []
        for case in cases:
            kw = {k: v for k, v in case.items() if k != "policy"}
            policy = case.get("policy", a.policy)
            res = measure_sharded(policy=policy, **kw)
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, res)
            results.append({"settings": kw, "policy": policy, "world_size": dist.get_world_size(), "ranks": out})
        if dist.get_rank() == 0:
            from lora_kit.results import write_text_atomic
            write_text_atomic(a.out, json.dumps(results if isinstance(settings, list) else results[0], indent=1))
        dist.barrier()  # no rank tears its process group down while another is still in a collective or writing
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    # Done, the results on disk and every rank past the barrier: leave without the interpreter's finalization. Under
    # CPU contention a rank was lost about once in 16 launches (SIGABRT, "terminate called without an active
    # exception"); PyTorch's own gloo tests met the same abort inside the interpreter's teardown (PyImport_Cleanup /
    # _PyModule_ClearDict in the stacks of pytorch issues 65231 and 60998; gloo's worker threads outliving it:
    # pytorch PR 179291). Nothing is left to release here but memory and sockets, which the OS takes back.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
