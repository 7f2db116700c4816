"""The shared rows of ``benchmarks/reference/cuda_h200.json`` (real steps on one H200) beside the kit's figures.

Per row: ``estimate``'s peak allocated (the step's tensors, and with the two cuBLAS workspaces torch counts on CUDA,
:func:`lora_kit.memory.device.cuda_allocated_bytes`) and device total; the device total on the stated basis
(:func:`lora_kit.memory.device.device_parts`: the H200's context from the catalog + torch's reserved in closed form
from the estimate's peak + memory outside the allocator, + paged optimizer states resident) against what the process
added to nvidia-smi (the shared rows were fitted on: the outside term on all six, the QLoRA load term on
``l8b-qlora-ckpt-s2048``); the reserved bytes of PyTorch's caching allocator replayed
(:mod:`lora_kit.memory.allocator`, default and ``expandable_segments:True``) over ``simulate``'s allocation sequence;
and the measured ``max_memory_allocated``, ``max_memory_reserved`` and what the process added to nvidia-smi (its
peak minus what was used before it started).

The sequence replayed: the weights and the optimizer states as ``simulate`` tracks them (already live, in that
order), then its tracked step twice (steady state). Not replayed: loading (for QLoRA, bitsandbytes quantising on
load, which leaves blocks behind) and the first step's own order, so reserved after load is not reproduced.
``simulate`` follows CPU kernels (pitfalls: "A CPU step is not a CUDA step"). The events are read from
``LiveBytesTracker`` through a subclass here (births and deaths of storages); the tracker has no public hook for it.

    python benchmarks/cuda_h200.py [--rows l8b-lora-ckpt-s2048,...] [--out benchmarks/results/cuda_h200.json]
    python benchmarks/cuda_h200.py --predict-held-back   # the rows issue 34 scores, before their figures are seen
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lora_kit as lk  # noqa: E402
from lora_kit.memory import simulate as sim_mod  # noqa: E402
from lora_kit.memory.allocator import replay  # noqa: E402
from lora_kit.memory.cuda_kernels import kernel_extra, math_kernel_extra  # noqa: E402
from lora_kit.memory.device import cuda_allocated_bytes, device_kwargs, device_parts  # noqa: E402
from lora_kit.memory.estimate import paged_resident  # noqa: E402
from lora_kit.memory.specs import model_spec  # noqa: E402
from lora_kit.memory.tracker import LiveBytesTracker, kernel_temporaries  # noqa: E402
from lora_kit.plan.gpus import get_gpu  # noqa: E402
from lora_kit.plan.timing import step_time  # noqa: E402
from lora_kit.results import write_json_atomic  # noqa: E402
from lora_kit.settings import as_step  # noqa: E402

REFERENCE = ROOT / "benchmarks" / "reference" / "cuda_h200.json"
GIB = 2 ** 30


class EventTracker(LiveBytesTracker):
    """A LiveBytesTracker that also keeps ("alloc", serial, bytes) / ("free", serial) in the order they happen."""
    last = None

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.events: list[tuple] = []
        EventTracker.last = self

    def _add_storage(self, st):
        new = self._serial_of.get(st._cdata) is None
        serial = super()._add_storage(st)
        if new and self._live.get(serial):
            self.events.append(("alloc", serial, self._live[serial]))
        return serial

    def reset_peak(self):  # simulate calls it once what was live before the step is tracked
        self.mark = len(self.events)
        super().reset_peak()

    def device_events(self) -> tuple[list, int]:
        """(events, how many of them come before the step) of what torch's CUDA allocator sees: without the paged
        optimizer states, which bitsandbytes keeps in CUDA managed memory, outside the allocator (``simulate`` leaves
        them out of its peak for the same reason)."""
        paged = {s for s, c in self._labels.items() if c == "paged_optimizer_states"}
        keep = [e[1] not in paged for e in self.events]
        return [e for e, k in zip(self.events, keep) if k], sum(keep[:self.mark])

    def _free(self, serial, cdata):
        if self._live.get(serial):
            self.events.append(("free", serial))
        super()._free(serial, cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Storages an opaque operator allocates and frees inside itself (``kernel_temporaries``: bitsandbytes' 4-bit
        matmul dequantising its weight) go to the allocator too: allocated before its output, freed after."""
        inside = [] if self._paused else [(("inside", len(self.events), i), b)
                                          for i, b in enumerate(kernel_temporaries(func, args, kwargs, self.block))]
        self.events.extend(("alloc", serial, b) for serial, b in inside)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.events.extend(("free", serial) for serial, _ in inside)
        return out


def step_kwargs(row: dict) -> dict:
    st = row["settings"]
    kw = dict(method=st["method"], seq_len=st["seq"], batch_size=st["batch"], gradient_checkpointing=st["ckpt"],
              optimizer=st["optim"], dtype="bfloat16")
    if st["method"] != "full":
        kw.update(lora_rank=st["rank"], lora_alpha=st["alpha"], lora_targets=st["targets"])
    return kw


def steady_state(events: list, n_live_before: int) -> list:
    """The tracked step twice after what was live before it (its first ``n_live_before`` allocations)."""
    pre, step = events[:n_live_before], events[n_live_before:]
    second = [(e[0], ("2", e[1])) + tuple(e[2:]) for e in step]
    return pre + step + second


def simulate_with_events(model, trace: bool = False, **kw):
    """``lora_kit.simulate(model, **kw)`` (with its trace when ``trace``) and the steady-state allocation sequence of
    its step (:func:`steady_state`)."""
    orig = sim_mod.LiveBytesTracker
    sim_mod.LiveBytesTracker = EventTracker
    try:
        sim = lk.simulate(model, trace=trace, **kw)
    finally:
        sim_mod.LiveBytesTracker = orig
    return sim, steady_state(*EventTracker.last.device_events())


def replayed(events: list) -> dict:
    """Reserved (and allocated, inactive split) of ``events`` under both allocator settings."""
    out = {}
    for name, exp in (("default", False), ("expandable", True)):
        v = replay(events, expandable_segments=exp)
        out[name] = {"max_allocated": v.max_allocated, "max_reserved": v.max_reserved,
                     "max_inactive_split": v.max_inactive_split}
    return out


def device_basis(model: str, kw: dict, est, gpu: str = "H200", allocator: str = "default") -> dict:
    """The device total on the stated basis (:func:`lora_kit.memory.device.device_parts`) for ``est``: the GPU's
    context from the catalog, torch's reserved in closed form for the ``allocator`` setting the row ran with (the
    estimate's own device total is the default setting's), memory outside the allocator, and the paged optimizer
    states resident beside them (what nvidia-smi shows while there is room:
    :func:`lora_kit.memory.estimate.paged_resident`)."""
    g = get_gpu(gpu)
    parts = device_parts(est.peak_allocated_bytes, context=int(g["context_bytes"]), allocator=allocator,
                         **device_kwargs(model_spec(model), as_step(None, **kw)))
    paged = paged_resident(model, **kw)
    return {**parts, "paged_resident": int(paged), "nvidia_smi_process": parts["total"] + int(paged)}


def figures(model, kw: dict, allocator: str, torch_version: str) -> dict:
    """The kit's figures for one step on the H200 (nothing measured): ``estimate``'s peak, device total and CUDA
    allocated (+ the kernels CUDA runs there, placed on ``simulate``'s trace), the device basis, the allocator
    replays and the predicted step time."""
    est = lk.estimate(model=model, **kw)
    basis = device_basis(model, kw, est, allocator=allocator)
    t0 = time.perf_counter()
    sim, events = simulate_with_events(model, trace=True, **kw)
    seconds = time.perf_counter() - t0
    h200 = get_gpu("H200")
    cuda_alloc = cuda_allocated_bytes(est.peak_allocated_bytes, h200["compute_capability"], torch_version)
    # CUDA's math-kernel fallback for fp32 q/k/v with grouped K/V heads, placed on the simulated step (0: a fused
    # kernel, or a peak that lies elsewhere)
    math = math_kernel_extra(model, sim=sim, torch_version_=torch_version,
                             compute_capability=h200["compute_capability"], **kw)
    # with it, the weights bitsandbytes' 4-bit matmul dequantises inside itself, placed together
    kernels = kernel_extra(model, sim=sim, torch_version_=torch_version,
                           compute_capability=h200["compute_capability"], **kw)
    t = step_time(model, h200, **kw)  # the attention kernel by the installed torch's rules (2.11-2.13 agree)
    return {"estimate": {"peak_allocated": est.peak_allocated_bytes, "device_total": est.device_total_bytes,
                         "cuda_allocated": cuda_alloc, "math_kernel_extra": math, "kernel_extra": kernels,
                         "cuda_allocated_with_kernels": None if kernels is None else cuda_alloc + kernels},
            "device_basis": basis,
            "simulate": {"peak_allocated": sim.peak_allocated_bytes, "seconds": round(seconds, 1),
                         "events_replayed": len(events)},
            "replay": replayed(events),
            "time": {"step_seconds": t["step_seconds"], "interval_seconds": list(t["interval_seconds"]),
                     "attention_kernel": t["attention_kernel"]}}


def one(row: dict) -> dict:
    kw = step_kwargs(row)
    expandable = row["settings"].get("alloc") == "expandable_segments:True"
    allocator, torch_version = "expandable" if expandable else "default", row["versions"]["torch"]
    f = figures(row["model"], kw, allocator, torch_version)
    est, basis, rep = f["estimate"], f["device_basis"], f["replay"]
    cuda_alloc, math, kernels = est["cuda_allocated"], est["math_kernel_extra"], est["kernel_extra"]
    added = row["peak_nvml"] - row["nvml_used_before_context"]
    context = get_gpu("H200")["context_bytes"]
    reserved = rep[allocator]["max_reserved"]
    return {
        "case": row["case"], "model": row["model"], "settings": kw, "allocator": allocator,
        "measured": {"max_allocated": row["peak_allocated"], "max_reserved": row["peak_reserved"],
                     "process_added_nvidia_smi": added, "context": row["context_used"]},
        **f,
        "ratios": {"estimate_allocated": est["peak_allocated"] / row["peak_allocated"],
                   "cuda_allocated": cuda_alloc / row["peak_allocated"],
                   # None where the math kernel runs on inputs math_kernel_extra does not size (16-bit, a mask)
                   "cuda_allocated_with_math": None if math is None else (cuda_alloc + math) / row["peak_allocated"],
                   "cuda_allocated_with_kernels": None if kernels is None
                   else (cuda_alloc + kernels) / row["peak_allocated"],
                   "replay_reserved": reserved / row["peak_reserved"],
                   "estimate_device_total_vs_added": est["device_total"] / added,
                   "basis_reserved_vs_measured": basis["reserved"] / row["peak_reserved"],
                   "device_total_vs_added": basis["nvidia_smi_process"] / added,
                   "context_plus_replay_vs_added": (context + reserved) / added},
    }


# The held-back rows of the same run, as issue 34's "Done when" names them (their measured figures are not shared):
# (case, model, layers kept or None, step). Unstated settings are the shared rows' recipe (bf16, alpha 32, LoRA
# dropout 0, AdamW) and each model's own attention implementation (Gemma-2: eager, as stated).
HELD_BACK = (
    ("llama65b-4L-qlora-paged32", "llama-65b", 4, dict(method="qlora", lora_rank=64, lora_alpha=16, seq_len=512,
                                                       optimizer="paged_adamw_32bit")),
    ("llama65b-8L-qlora-paged32", "llama-65b", 8, dict(method="qlora", lora_rank=64, lora_alpha=16, seq_len=512,
                                                       optimizer="paged_adamw_32bit")),
    ("q25-7b-qlora-s4096-b2", "qwen2.5-7b", None, dict(method="qlora", seq_len=4096, batch_size=2)),
    ("m7b-lora-s4096-b4", "mistral-7b", None, dict(method="lora", seq_len=4096, batch_size=4)),
    ("g2-9b-qlora-eager-s2048", "gemma-2-9b", None, dict(method="qlora", seq_len=2048, attn_implementation="eager")),
    ("l8b-qlora-s4096-b4-paged8", "llama-3.1-8b", None, dict(method="qlora", seq_len=4096, batch_size=4,
                                                             optimizer="paged_adamw_8bit")),
    ("l3b-full-s2048-b8", "llama-3.2-3b", None, dict(method="full", seq_len=2048, batch_size=8)),
)
HELD_BACK_COMMON = dict(dtype="bfloat16", gradient_checkpointing=True, batch_size=1, lora_rank=16, lora_alpha=32,
                        lora_targets="all-linear", optimizer="adamw")
PREDICTED = ROOT / "benchmarks" / "results" / "cuda_h200_predicted.json"


def held_back_model(name: str, layers: int | None):
    """A catalog model, or its config cut to ``layers`` decoder layers (a PretrainedConfig)."""
    if layers is None:
        return name
    from transformers import AutoConfig
    from lora_kit.memory.specs import catalog_config
    c = {k: v for k, v in catalog_config(name).items() if not k.startswith("_")}
    return AutoConfig.for_model(c.pop("model_type"), **{**c, "num_hidden_layers": layers})


def predict_held_back(torch_version: str = "2.11.0+cu130") -> list:
    """The kit's figures for each :data:`HELD_BACK` row on the H200 with the reference run's torch, under both
    allocator settings (the rows ran with PyTorch's default)."""
    out = []
    for case, model, layers, st in HELD_BACK:
        kw = {**HELD_BACK_COMMON, **st}
        if kw["method"] == "full":
            kw = {k: v for k, v in kw.items() if not k.startswith("lora_")}
        f = figures(held_back_model(model, layers), kw, "default", torch_version)
        paged = f["device_basis"]["paged_resident"]
        out.append({"case": case, "model": model, "layers": layers, "settings": kw, "torch": torch_version, **f,
                    "nvidia_smi_process_added": f["estimate"]["device_total"] + paged})
        e = f["estimate"]
        print(f"{case:28}{e['peak_allocated'] / GIB:>10.3f}{e['cuda_allocated'] / GIB:>10.3f}"
              f"{(e['cuda_allocated_with_kernels'] or 0) / GIB:>12.3f}{f['replay']['default']['max_reserved'] / GIB:>10.3f}"
              f"{e['device_total'] / GIB:>10.3f}{paged / GIB:>8.3f}{f['time']['step_seconds']:>9.3f}"
              f"  {f['time']['attention_kernel']}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None, help="comma-separated case names (default: every shared step row)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_h200.json"))
    p.add_argument("--predict-held-back", action="store_true",
                   help=f"the kit's figures for the held-back rows (issue 34), into {PREDICTED.relative_to(ROOT)}")
    a = p.parse_args(argv)
    if a.predict_held_back:
        print(f"{'case':<28}{'est GiB':>10}{'+cuBLAS':>10}{'+kernels':>12}{'replay':>10}{'dev.tot':>10}{'paged':>8}"
              f"{'step s':>9}  attention")
        rows = predict_held_back()
        write_json_atomic(PREDICTED, {"_about": "The kit's figures for the held-back rows of "
                                      f"{REFERENCE.relative_to(ROOT)} (their measured figures are not in this "
                                      "repository), computed before they are seen: python benchmarks/cuda_h200.py "
                                      "--predict-held-back. Machine: " + os.uname().machine + " CPU.", "rows": rows})
        print(f"wrote {PREDICTED}")
        return 0
    ref = json.loads(REFERENCE.read_text())
    rows = [r for r in ref["rows"] if "settings" in r]
    if a.rows:
        want = a.rows.split(",")
        rows = [r for r in rows if r["case"] in want]
    out = []
    print(f"{'case':<34}{'alloc est/meas':>15}{'+cuBLAS/meas':>13}{'reserved replay/meas':>22}{'meas GiB':>10}"
          f"{'dev.total/added':>17}{'ctx+replay/added':>18}{'basis res/meas':>16}{'basis total/added':>19}")
    for r in rows:
        res = one(r)
        out.append(res)
        q = res["ratios"]
        print(f"{r['case']:<34}{q['estimate_allocated']:>15.4f}{q['cuda_allocated']:>13.5f}"
              f"{q['replay_reserved']:>22.4f}{r['peak_reserved'] / GIB:>10.2f}{q['estimate_device_total_vs_added']:>17.4f}"
              f"{q['context_plus_replay_vs_added']:>18.4f}{q['basis_reserved_vs_measured']:>16.4f}"
              f"{q['device_total_vs_added']:>19.4f}", flush=True)
    band = [r["ratios"]["device_total_vs_added"] for r in out]
    print(f"device total (context + reserved + outside + paged resident) / what the process added to nvidia-smi: "
          f"min {min(band):.4f}, max {max(band):.4f} (target 0.97-1.10)")
    write_json_atomic(a.out, {"_about": __doc__.split("\n\n")[0] + " Machine that computed the kit's figures: "
                              + os.uname().machine + " CPU; measured figures: the reference file.",
                              "reference": str(REFERENCE.relative_to(ROOT)), "rows": out})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
