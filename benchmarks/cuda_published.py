"""Published GPU runs (``benchmarks/reference/published_cuda_rows.json``) beside the kit's figure of the same metric.

Every row of the reference file comes back once. An in-scope row is compared with the kit's figure for the metric
its source reports, never another:

- ``allocated`` (``torch.cuda.max_memory_allocated``): ``estimate``'s ``peak_allocated_bytes`` plus the two cuBLAS
  workspaces that counter holds (:func:`lora_kit.memory.device.cuda_allocated_bytes`, by the row's compute
  capability: its catalog GPU's, or the row's own ``compute_capability``).
- ``reserved`` (``torch.cuda.max_memory_reserved``): the estimate's reserved bytes (the closed form of
  :mod:`lora_kit.memory.device` from its peak: the reserved part of ``device_total_bytes``). The estimate's
  ``peak_allocated_bytes`` is shown beside (reserved is never below allocated).
- ``nvidia-smi`` (the device's used memory): ``estimate``'s ``device_total_bytes`` (context + reserved + outside
  the allocator, what the process adds), the paged optimizer states resident, plus the GPU's driver share
  (``lora_kit.plan.gpus``: nvidia-smi's total minus CUDA's), labelled where the share is unknown.

Beside the figure of a ``reserved`` or ``nvidia-smi`` row, the cross-check ``replay_figure``: the same with the
reserved bytes of PyTorch's caching allocator replayed (:mod:`lora_kit.memory.allocator`, the setting the row ran
with; the sources name none, so PyTorch's default, ``expandable_segments:True`` shown beside) over ``simulate``'s
allocation sequence of the step at the row's full depth (the weights and optimizer states, then the step twice, as
``benchmarks/cuda_h200.py`` replays it). A published row is never simulated at reduced depth: where ``simulate``
cannot run the step, ``replay_not_run`` says why.

Where a row names its own stack (``stack``: the library versions it ran) and that stack's code moves the peak where
the installed one does not, the cross-check ``row_stack``: ``simulate`` at full depth with those differences
applied (:data:`STACK_DIFFERENCES`, each read in that version's source), turned into the row's metric the same way,
beside the kit's figure, never in its place: the kit prints the installed stack's figure, and that figure is what
is scored.

Per row also the ratio kit / measured, the closed-form reserved of :mod:`lora_kit.memory.device` / measured, and the
verdict at margin 0 twice: ``estimate``'s ``device_total_bytes`` as the tree computes it, and the device total on the
stated basis (``device_kwargs`` passed: what ``estimate`` gives once it passes them), never the paged states,
against the GPU's
CUDA-visible capacity (``cuda_capacity_bytes``), beside what happened (a row with a published peak ran; a row may
say ``"outcome": "oom"``). Rows whose GPU is not in the catalog get no verdict, said so. Out-of-scope rows are
listed with their reason. ``simulate`` follows CPU kernels (pitfalls: "A CPU step is not a CUDA step").

    python benchmarks/cuda_published.py [--no-replay] [--rows 'published_gpu_runs[0],...'] \\
        [--out benchmarks/results/cuda_published.json]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from packaging.version import Version

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lora_kit as lk  # noqa: E402
from lora_kit.memory import sharded as sharded_mod  # noqa: E402
from lora_kit.memory import simulate as sim_mod  # noqa: E402
from lora_kit.memory.device import cuda_allocated_bytes, device_kwargs, device_parts  # noqa: E402
from lora_kit.memory.specs import model_spec  # noqa: E402
from lora_kit.memory.tracker import LiveBytesTracker  # noqa: E402
from lora_kit.plan.gpus import compute_capability, get_gpu  # noqa: E402
from lora_kit.results import write_json_atomic  # noqa: E402
from lora_kit.settings import as_step  # noqa: E402

from calibrate_accuracy import machine  # noqa: E402
from cuda_h200 import EventTracker, replayed, steady_state  # noqa: E402
from lora_kit.memory.fits import versions  # noqa: E402

REFERENCE = ROOT / "benchmarks" / "reference" / "published_cuda_rows.json"
OUT = ROOT / "benchmarks" / "results" / "cuda_published.json"
METRICS = ("allocated", "reserved", "nvidia-smi")
ALLOCATOR = "default"  # the allocator setting the published runs used: none of the sources names another
SHORT, OVER_MEDIAN = 0.97, 1.15  # issue 34's targets: never more than 3 % short, at most 15 % over in the median
GIB = 2 ** 30


class ResizeEventTracker(EventTracker):
    """:class:`cuda_h200.EventTracker` that also turns a storage resized in place into events: FSDP2 frees a gathered
    parameter with ``resize_(0)`` and re-allocates it with ``resize_(n)``; on CUDA that is a free of the old block
    and a new allocation, so a resize is ``("free", old key)`` then ``("alloc", new key, bytes)``."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._key: dict = {}  # serial -> the key of its current block, once resized

    def _add_storage(self, st):
        serial = self._serial_of.get(st._cdata)
        old = self._live.get(serial) if serial is not None else None
        out = super()._add_storage(st)
        new = self._live.get(serial) if serial is not None else None
        if old is not None and new != old:
            if old:
                self.events.append(("free", self._key.get(serial, serial)))
            if new:
                self._key[serial] = ("resized", serial, len(self.events))
                self.events.append(("alloc", self._key[serial], new))
        return out

    def _free(self, serial, cdata):
        key = self._key.pop(serial, None)
        if key is not None and self._live.get(serial):
            self.events.append(("free", key))
            LiveBytesTracker._free(self, serial, cdata)
        else:
            super()._free(serial, cdata)


def simulate_events(model, plan: dict):
    """``lora_kit.simulate(model, **plan)`` at full depth and the steady-state allocation sequence of its step
    (one GPU and FSDP2 alike)."""
    saved = sim_mod.LiveBytesTracker, sharded_mod.LiveBytesTracker
    sim_mod.LiveBytesTracker = sharded_mod.LiveBytesTracker = ResizeEventTracker
    try:
        sim = lk.simulate(model, **plan)
    finally:
        sim_mod.LiveBytesTracker, sharded_mod.LiveBytesTracker = saved
    return sim, steady_state(*ResizeEventTracker.last.device_events())


def _loss_with_shifted_copy(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kw):
    """Causal-LM loss as transformers 4.48 computes it (``ForCausalLMLoss``, ``src/transformers/loss/loss_utils.py``
    at v4.48.1): the fp32 logits are shifted by a contiguous copy, so one more fp32 (tokens x vocabulary) tensor is
    live while cross-entropy runs. 4.49 pads the labels instead and shifts no logits."""
    from transformers.loss.loss_utils import fixed_cross_entropy
    logits = logits.float()
    shifted = logits[..., :-1, :].contiguous().view(-1, vocab_size)
    targets = labels.to(logits.device)[..., 1:].contiguous().view(-1)
    return fixed_cross_entropy(shifted, targets, num_items_in_batch, ignore_index, **kw)


@contextlib.contextmanager
def _older_loss():
    from transformers.loss import loss_utils
    saved = loss_utils.LOSS_MAPPING["ForCausalLM"]
    loss_utils.LOSS_MAPPING["ForCausalLM"] = _loss_with_shifted_copy
    try:
        yield
    finally:
        loss_utils.LOSS_MAPPING["ForCausalLM"] = saved


@contextlib.contextmanager
def _trl_013_qlora_casts():
    """TRL 0.13's ``SFTTrainer`` on a 4-bit model with ``bf16=True`` (``peft_module_casting_to_bf16``,
    ``trl/trainer/utils.py`` at v0.13.0): after ``prepare_model_for_kbit_training`` the norms stay fp32 and the
    embeddings and ``lm_head`` go back to bf16."""
    import peft
    import torch
    prepare = peft.prepare_model_for_kbit_training

    def prepared_then_cast(model, *a, **k):
        model = prepare(model, *a, **k)
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if "norm" not in name and any(x in name for x in ("lm_head", "embed_tokens")) and \
                    weight is not None and weight.dtype == torch.float32:
                module.to(torch.bfloat16)
        return model

    peft.prepare_model_for_kbit_training = prepared_then_cast
    try:
        yield
    finally:
        peft.prepare_model_for_kbit_training = prepare


# (what differs, when it applies to a row's stack and plan, how simulate is made to run it)
STACK_DIFFERENCES = (
    ("transformers <= 4.48: the causal-LM loss copies the shifted fp32 logits",
     lambda stack, plan: "transformers" in stack and Version(stack["transformers"]) < Version("4.49"), _older_loss),
    ("TRL 0.13 SFTTrainer, QLoRA with bf16: embeddings and lm_head cast back to bf16 after "
     "prepare_model_for_kbit_training",
     lambda stack, plan: stack.get("trl") == "0.13" and plan.get("method") == "qlora" and plan.get("autocast")
     and plan.get("qlora_prepare") == "peft", _trl_013_qlora_casts),
)


def row_stack(row: dict, est, gpu: dict | None) -> dict | None:
    """The cross-check on the row's own stack (module doc), or None where its stack differs in nothing listed in
    :data:`STACK_DIFFERENCES` (or names none)."""
    stack, plan = row.get("stack") or {}, row["plan"]
    apply = [(what, patch) for what, when, patch in STACK_DIFFERENCES if when(stack, plan)]
    if not apply:
        return None
    with contextlib.ExitStack() as patches:
        for _, patch in apply:
            patches.enter_context(patch())
        peak = lk.simulate(row["model"], **plan).peak_allocated_bytes
    moved = dataclasses.replace(est, peak_allocated_bytes=peak)
    moved.device_total_bytes = est.device_total_bytes + basis(row, moved, gpu)["reserved"] - basis(row, est, gpu)[
        "reserved"]
    figure = kit_figure(row, moved, gpu, replay=False)["figure"]
    return {"stack": stack, "differences": [what for what, _ in apply], "peak_allocated": peak, "figure": figure,
            "basis": "simulate at full depth with the differences applied, then as the kit's figure"}


def basis(row: dict, est, gpu: dict | None) -> dict:
    """The device total on the stated basis (:func:`lora_kit.memory.device.device_parts`) for the row's plan: the
    GPU's context (catalog; the default where the GPU is not in it), torch's reserved in closed form from the
    estimate's peak, memory outside the allocator (NCCL per rank when ``num_gpus`` > 1), and the paged optimizer
    states resident beside them (the estimate with the unpaged twin less its own states)."""
    plan = row["plan"]
    parts = device_parts(est.peak_allocated_bytes, context=int(gpu["context_bytes"]) if gpu else None,
                         **device_kwargs(model_spec(row["model"]), as_step(None, **plan)))
    opt, paged = plan.get("optimizer", "adamw"), 0
    if opt.startswith("paged_"):
        twin = lk.estimate(model=row["model"], **{**plan, "optimizer": opt.removeprefix("paged_")})
        paged = twin.breakdown["optimizer_states"] - est.breakdown["optimizer_states"]
    return {**parts, "paged_resident": int(paged)}


def estimate_reserved(row: dict, est, gpu: dict | None) -> tuple[int, str]:
    """The estimate's reserved bytes (the closed form of :mod:`lora_kit.memory.device`) and its label."""
    return basis(row, est, gpu)["reserved"], "closed-form reserved (lora_kit.memory.device.reserved_bytes)"


def _replay(row: dict, replay: bool) -> tuple[dict | None, str | None]:
    """The allocator replay (both settings, :func:`cuda_h200.replayed`) of ``simulate``'s step at the row's full
    depth, with what was simulated, and None; or None and why not (``replay`` off, or what ``simulate`` says of a
    step it cannot run)."""
    if not replay:
        return None, "replay not run (--no-replay)"
    t0 = time.perf_counter()
    try:
        sim, events = simulate_events(row["model"], row["plan"])
    except ValueError as e:  # simulate says which steps it cannot run, and what to use instead
        return None, f"simulate cannot run this step at full depth: {e}"
    return {**replayed(events), "simulate": {"peak_allocated": sim.peak_allocated_bytes,
                                             "events_replayed": len(events),
                                             "seconds": round(time.perf_counter() - t0, 1)}}, None


def kit_figure(row: dict, est, gpu: dict | None, replay: bool) -> dict:
    """The kit's figure for the metric ``row`` reports, with its basis and what else was computed for it."""
    metric = row["metric"]
    b = basis(row, est, gpu)
    out: dict = {"estimate_allocated": est.peak_allocated_bytes, "estimate_device_total": est.device_total_bytes,
                 "device_basis": b}
    if metric == "allocated":  # torch's counter also holds the two cuBLAS workspaces, sized by compute capability
        cc = compute_capability(gpu) if gpu else row.get("compute_capability")
        out.update(figure=cuda_allocated_bytes(est.peak_allocated_bytes, cc),
                   basis="estimate.peak_allocated_bytes + two cuBLAS workspaces "
                         f"(lora_kit.memory.device.cuda_allocated_bytes, compute capability {cc or 'unknown: 32 MiB'})")
    elif metric == "nvidia-smi":
        share = gpu.get("driver_share_bytes") if gpu else None
        known = not (share is None or share != share)  # NaN: the catalog lacks nvidia-smi's total or CUDA's
        seen = est.device_total_bytes + b["paged_resident"]  # what the process adds to nvidia-smi, paged resident
        add = int(share) if known else 0
        out.update(figure=seen + add, driver_share=int(share) if known else None,
                   basis="estimate.device_total_bytes + paged resident + " +
                         (f"driver share of {gpu['name']} (lora_kit.plan.gpus)" if known else
                          "no driver share: this GPU's is not in the catalog (the figure is short by it)"))
        rep, why = _replay(row, replay)
        if rep:  # the same with the allocator replay's reserved in place of the closed form's
            out.update(replay_figure=seen + rep[ALLOCATOR]["max_reserved"] - b["reserved"] + add, replay=rep)
        else:
            out.update(replay_not_run=why)
    elif metric == "reserved":
        fallback, label = estimate_reserved(row, est, gpu)
        out.update(figure=fallback, basis=label)
        rep, why = _replay(row, replay)
        if rep:
            out.update(replay_figure=rep[ALLOCATOR]["max_reserved"], replay=rep)
        else:
            out.update(replay_not_run=why)
    else:
        raise ValueError(f"row {row['id']}: metric {metric!r} is not one of {', '.join(METRICS)}; fix the reference "
                         "file or move the row out of scope with a reason.")
    return out


def verdict(row: dict, est, gpu: dict | None) -> dict:
    """Fits / out of memory at margin 0 (device total against the CUDA-visible capacity) beside what happened."""
    happened = row.get("outcome", "ran")
    if gpu is None:
        return {"judged": False, "happened": happened,
                "why_not": f"GPU {row.get('gpu_as_published')!r} is not in the catalog (no CUDA-visible capacity)"}
    cap = int(gpu["cuda_capacity_bytes"])
    total = est.device_total_bytes  # paged states resident when room: never in the verdict
    b = basis(row, est, gpu)["total"]  # the same with device_kwargs passed (what estimate gives once it passes them)
    fits = total <= cap
    return {"judged": True, "gpu": gpu["name"], "capacity": cap, "capacity_basis": gpu["cuda_capacity_basis"],
            "device_total": total, "device_total_over_capacity": total / cap, "basis_device_total": b,
            "basis_predicted": "fits" if b <= cap else "oom", "basis_right": (happened == "oom") != (b <= cap),
            "predicted": "fits" if fits else "oom", "happened": happened, "right": (happened == "oom") != fits}


# the catalog's names; mistral-7b is v0.3 (32,768-token vocabulary; v0.1's 32,000 make the logits 2.3 % smaller)
FMS_MODELS = {"mistralai/Mistral-7B-v0.1": "mistral-7b", "NousResearch/Llama-2-70b-hf": "llama-2-70b"}


def fms_rows() -> list[dict]:
    """fms-acceleration's single-GPU A100-80GB runs of the plain HF stack (``time_rows_build.fms_runs``: the
    committed CSV read once for the time and the memory rows): each run that finished gives two rows, torch's peak
    allocated (``mem_peak_torch_mem_alloc_in_bytes``, the Trainer's memory tracker over init and train) and
    nvidia-smi's peak used memory (``mem_nvidia_mem_reserved``, MiB, polled by nvidia-smi during the run); each run
    that did not finish (no runtime, no torch peak: out of memory) one row with ``"outcome": "oom"``."""
    from time_rows_build import FMS_COMMIT, FMS_URL, fms_runs
    rows = []
    for run in fms_runs():
        if run["out_of_scope"]:
            continue  # other stacks, several GPUs (planned elsewhere) and models outside the catalog: time_rows'
        model, method = run["model"], run["method"]
        plan = {k: v for k, v in run["step"].items() if method != "full" or not k.startswith("lora")}
        plan["loop"] = "kit"  # transformers 4.48's Trainer ran torch's foreach AdamW, as the kit's own loop does
        base = {"source": "foundation-model-stack/fms-acceleration reference benchmarks (A100-80GB)", "url": FMS_URL,
                "model_as_published": model, "method_as_published": run["framework"],
                "gpu_as_published": "A100-80GB", "in_scope": True, "model": FMS_MODELS[model], "gpu": "A100-80GB",
                "plan": plan, "stack": {"transformers": "4.48.1", "trl": "0.13", "torch": "2.4.1"},
                "caveats": f"CSV row {run['csv_row']} at {FMS_COMMIT[:7]}: TRL 0.13 SFTTrainer (its loss is the "
                "model's), transformers 4.48.1 (whose Trainer defaulted to optim adamw_torch: torch's foreach AdamW, "
                "what the kit's own loop runs; loop 'trainer' follows transformers 5.24's adamw_torch_fused), torch "
                "2.4.1, rows packed to 4096 tokens; QLoRA: TRL also casts adapters, lm_head and embeddings to bf16; "
                "mistral-7b in the catalog is v0.3 (32,768-token vocabulary, v0.1 has 32,000)"}
        slug = f"fms:{model.split('/')[-1]}-{method}-b{plan['batch_size']}"
        if run["runtime"] is None:
            rows.append({**base, "id": slug, "metric": "nvidia-smi", "unit": "MiB",
                         "value_as_published": run["nvidia_smi_mib"], "value_bytes": None, "outcome": "oom"})
            continue
        rows.append({**base, "id": f"{slug}-allocated", "metric": "allocated", "unit": "B",
                     "value_as_published": run["allocated"], "value_bytes": int(float(run["allocated"]))})
        rows.append({**base, "id": f"{slug}-nvidia-smi", "metric": "nvidia-smi", "unit": "MiB",
                     "value_as_published": run["nvidia_smi_mib"],
                     "value_bytes": int(float(run["nvidia_smi_mib"]) * 2 ** 20)})
    return rows


def compare(rows: list[dict], replay: bool = True, row_stacks: bool | None = None) -> list[dict]:
    """One result per reference row, in order: in-scope rows compared with the kit's figure of their metric,
    out-of-scope rows with their reason; ``row_stacks`` (default: as ``replay``, both run ``simulate``): the
    cross-check on the row's own stack where it differs."""
    row_stacks = replay if row_stacks is None else row_stacks
    out = []
    for row in rows:
        base = {"id": row["id"], "source": row["source"], "url": row.get("url"), "metric": row["metric"],
                "in_scope": bool(row["in_scope"])}
        if not row["in_scope"]:
            out.append({**base, "reason": row["reason"]})
            continue
        est = lk.estimate(model=row["model"], **row["plan"])
        gpu = get_gpu(row["gpu"]) if row.get("gpu") else None
        kit = kit_figure(row, est, gpu, replay)
        measured = int(row["value_bytes"]) if row.get("value_bytes") is not None else None  # None: ran out of memory
        out.append({**base, "model": row["model"], "plan": row["plan"], "gpu": row.get("gpu"),
                    "measured": measured, "kit": kit, "ratio": kit["figure"] / measured if measured else None,
                    "verdict": verdict(row, est, gpu), "caveats": row.get("caveats")})
        stack = row_stack(row, est, gpu) if measured and row_stacks else None
        if stack:
            out[-1]["row_stack"] = {**stack, "ratio": stack["figure"] / measured}
    return out


def summary(results: list[dict]) -> dict:
    """Ratios per metric and the verdict count, with issue 34's targets (stated for the device total) said met or
    not on the figure each row is compared with."""
    verdicts = [r for r in results if r["in_scope"]]
    inscope = [r for r in verdicts if r["ratio"] is not None]  # an out-of-memory row has a verdict, no figure
    per_metric, per_metric_replay, per_metric_row_stack = {}, {}, {}
    for m in METRICS:
        for into, rs in ((per_metric, [r["ratio"] for r in inscope if r["metric"] == m]),
                         (per_metric_replay, [r["kit"]["replay_figure"] / r["measured"] for r in inscope
                                              if r["metric"] == m and "replay_figure" in r["kit"]])):
            q = sorted(rs)
            if q:
                into[m] = {"rows": len(q), "min": q[0], "median": statistics.median(q), "max": q[-1],
                           "short_over_3pct": sum(x < SHORT for x in q)}
    for m in METRICS:
        q = sorted(r["row_stack"]["ratio"] for r in inscope if r["metric"] == m and "row_stack" in r)
        if q:
            per_metric_row_stack[m] = {"rows": len(q), "min": q[0], "median": statistics.median(q), "max": q[-1],
                                       "short_over_3pct": sum(x < SHORT for x in q)}
    ratios = [r["ratio"] for r in inscope]
    judged = [r["verdict"] for r in verdicts if r["verdict"]["judged"]]
    basis = {"verdicts_right": sum(v["basis_right"] for v in judged), "verdicts_judged": len(judged),
             "wrong": [r["id"] for r in verdicts if r["verdict"]["judged"] and not r["verdict"]["basis_right"]]}
    return {"rows": len(results), "in_scope": len(verdicts), "out_of_scope": len(results) - len(verdicts),
            "device_basis": basis,
            "per_metric": per_metric, "per_metric_replay": per_metric_replay,
            "per_metric_row_stack": per_metric_row_stack,
            "replayed": sum("replay" in r["kit"] for r in inscope),
            "verdicts_judged": len(judged), "verdicts_right": sum(v["right"] for v in judged),
            "verdicts_not_judged": len(verdicts) - len(judged),
            "targets_on_compared_figure": {"never_more_than_3pct_short": bool(ratios) and min(ratios) >= SHORT,
                        "median_at_most_15pct_over": bool(ratios) and statistics.median(ratios) <= OVER_MEDIAN,
                        "every_judged_verdict_right": all(v["right"] for v in judged)}}


def table(results: list[dict]) -> str:
    lines = [f"{'row':<26}{'metric':<11}{'model':<14}{'gpu':<10}{'measured GiB':>13}{'kit GiB':>9}{'kit/meas':>9}"
             f"{'replay/meas':>12}{'est.alloc/meas':>15}  {'verdict':<22}{'basis verdict':<22}kit figure"]
    for r in results:
        if not r["in_scope"]:
            continue
        v = r["verdict"]
        said = bsaid = "no catalog GPU"
        if v["judged"]:
            said = f"{v['predicted']} / {v['happened']} {'ok' if v['right'] else 'WRONG'}"
            bsaid = f"{v['basis_predicted']} / {v['happened']} {'ok' if v['basis_right'] else 'WRONG'}"
        k = r["kit"]
        if r["measured"] is None:  # out of memory: the verdict only
            lines.append(f"{r['id']:<26}{r['metric']:<11}{r['model']:<14}{str(r['gpu']):<10}{'oom':>13}"
                         f"{k['figure'] / GIB:>9.2f}{'':>9}{'':>12}{'':>15}  {said:<22}{bsaid:<22}{k['basis']}")
            continue
        lines.append(f"{r['id']:<26}{r['metric']:<11}{r['model']:<14}{str(r['gpu']):<10}{r['measured'] / GIB:>13.2f}"
                     f"{k['figure'] / GIB:>9.2f}{r['ratio']:>9.3f}"
                     f"{k['replay_figure'] / r['measured'] if 'replay_figure' in k else float('nan'):>12.3f}"
                     f"{k['estimate_allocated'] / r['measured']:>15.3f}  {said:<22}{bsaid:<22}{k['basis']}")
    stacked = [r for r in results if "row_stack" in r]
    if stacked:
        lines.append("on the row's own stack (cross-check; the kit's figure above is the one scored):")
        lines += [f"  {r['id']:<40}{r['metric']:<11}kit/meas {r['ratio']:.3f}  row stack/meas "
                  f"{r['row_stack']['ratio']:.3f}  ({'; '.join(r['row_stack']['differences'])})" for r in stacked]
    lines.append("out of scope:")
    lines += [f"  {r['id']:<26}{r['metric']:<11}{r['reason']}" for r in results if not r["in_scope"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-replay", action="store_true",
                   help="skip simulate: the allocator replay (the cross-check beside reserved and nvidia-smi rows) "
                        "and the row-stack cross-check")
    p.add_argument("--rows", default=None, help="comma-separated row ids (default: every row of the reference file)")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    ref = json.loads(REFERENCE.read_text())
    rows = ref["rows"] + fms_rows()
    if a.rows:
        want = a.rows.split(",")
        unknown = sorted(set(want) - {r["id"] for r in rows})
        if unknown:
            raise SystemExit(f"--rows: unknown id(s) {unknown}; the ids are the 'id' fields of {REFERENCE.name}.")
        rows = [r for r in rows if r["id"] in want]
    t0 = time.perf_counter()
    results = compare(rows, replay=not a.no_replay)
    print(table(results))
    s = summary(results)
    print(json.dumps(s, indent=1))
    command = " ".join(["python benchmarks/cuda_published.py", *(argv if argv is not None else sys.argv[1:])])
    meta = {"date": datetime.date.today().isoformat(), "command": command,
            "machine": "kit's figures: " + machine() + "; measured: the sources of the reference file",
            "versions": versions(), "seconds": round(time.perf_counter() - t0, 1)}
    write_json_atomic(a.out, {"_about": __doc__.split("\n\n")[0], "_meta": meta,
                              "reference": str(REFERENCE.relative_to(ROOT)), "summary": s, "rows": results})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
