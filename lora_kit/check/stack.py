"""Stack check: exact versions, the hardware, probes that try the real thing, and a verdict for the plan.

A lookup table ("bitsandbytes supports ARM64 since x.y") is not proof: each probe runs the real
operation on this machine's device and reports ``pass``, ``worked-around`` (a known trap is present
and the kit's own workaround, tried by the probe, avoids it), ``not applicable`` (with why) or
``fail`` (with the error text). The probes take a few seconds on a CPU; they build tiny models from
configs (nothing is downloaded).

Whether a result stops a run depends on what the run does: :func:`verdict` is the one place that
decides (``lora-kit check`` and notebook 00 both call it). A 4-bit failure blocks ``method="qlora"``,
not LoRA; a bf16 failure blocks ``dtype="bfloat16"``; an 8-bit optimizer failure blocks that
optimizer; and so on (:data:`NEEDS`). Failures the plan does not need, and traps worked around,
are warnings. ``report(settings)`` returns a JSON-ready dict with the verdict, ``format_table()``
the table ``lora-kit check`` prints.
"""
from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import time

import torch

from lora_kit.check import probes as stack_probes
from lora_kit.settings import Settings

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "tokenizers")


def _version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # noqa: BLE001 - not installed or broken install: report as missing
        return None


def _driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def floor_problems(installed: dict | None = None, requirements: list[str] | None = None) -> list[dict]:
    """Installed libraries outside what lora_kit declares it needs (its package metadata: the floors it is tested
    at), each ``{"package", "installed", "needs", "change"}``. ``installed``: name -> version (default: this
    environment's, :data:`PACKAGES`); ``requirements``: requirement strings (default: lora_kit's installed
    metadata; none when lora_kit runs from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version
    if requirements is None:
        try:
            requirements = requires("lora_kit") or []
        except PackageNotFoundError:
            requirements = []
    have = installed if installed is not None else {p: _version(p) for p in PACKAGES}
    out, seen = [], set()
    for text in requirements:
        req = Requirement(text)
        if not req.specifier or have.get(req.name) is None or (req.name, str(req.specifier)) in seen:
            continue  # no bound, or not installed (the probes say what that blocks), or said already
        # an optional package (an extra: bitsandbytes, trl) that is installed is used: its floor applies too
        optional = req.marker is not None and "extra" in str(req.marker)
        if req.marker is not None and not optional and not req.marker.evaluate():
            continue  # a marker of another Python or platform
        seen.add((req.name, str(req.specifier)))
        try:
            ok = req.specifier.contains(Version(have[req.name]), prereleases=True)
        except InvalidVersion:
            continue
        if not ok:
            out.append({"package": req.name, "installed": have[req.name], "needs": str(req.specifier),
                        "change": f"pip install -U '{req.name}{req.specifier}'",
                        "optional": optional})
    return out


def cpu_architecture() -> str:
    m = platform.machine().lower()
    return {"x86_64": "x86-64", "amd64": "x86-64", "aarch64": "ARM64", "arm64": "ARM64"}.get(m, m)


def versions() -> dict:
    """Versions and hardware; cheap (no probes). Recorded next to every smoke run."""
    v = {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES},
         "cuda": torch.version.cuda, "cudnn": None, "driver": None, "hip": getattr(torch.version, "hip", None)}
    hw = {"cpu_architecture": cpu_architecture(), "os": platform.platform(), "cpu_count": __import__("os").cpu_count(),
          "gpus": []}
    if torch.cuda.is_available():
        v["cudnn"] = torch.backends.cudnn.version()
        v["driver"] = _driver_version()
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            hw["gpus"].append({"name": p.name, "compute_capability": f"{p.major}.{p.minor}",
                               "memory_bytes": p.total_memory})
        hw["torch_cuda_arch_list"] = torch.cuda.get_arch_list()
    return {"versions": v, "hardware": hw}


def memory_reading(free: int, total: int) -> dict:
    """What ``torch.cuda.mem_get_info()`` says, labelled. Its *total* is the capacity a process can fill (the CUDA
    context lives inside it; nvidia-smi's larger total adds the driver's share). Its *free* is read after this
    process's context exists, so taking it as the capacity would count the context twice."""
    return {"cuda_total_bytes": int(total), "cuda_free_bytes": int(free),
            "basis": "torch.cuda.mem_get_info(): total = capacity; free = total - context - what is in use now"}


def cuda_memory(device=None) -> dict | None:
    """:func:`memory_reading` of ``device`` (default: the current one); None without CUDA. Creates the CUDA context
    of that device, so call it only for the device this process uses (``lora-kit check`` reads every GPU)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return memory_reading(free, total)


def notes(info: dict, probes: list[dict]) -> list[str]:
    """Known traps that apply to this stack."""
    out = ["A framework supporting a model does not mean every accelerated kernel works on this device: "
           "trust the probes above, not support tables."]
    hw, v = info["hardware"], info["versions"]
    if hw["cpu_architecture"] == "ARM64":
        out.append("ARM64 (GH200, GB10 / DGX Spark): torch, bitsandbytes and flash-attention need aarch64 builds "
                   "with kernels for this GPU; pip may silently install a CPU-only or x86-only wheel.")
    for g in hw["gpus"]:
        cc = g["compute_capability"].replace(".", "")
        arch = hw.get("torch_cuda_arch_list") or []
        if arch and f"sm_{cc}" not in arch and f"compute_{cc}" not in arch:
            out.append(f"{g['name']} (sm_{cc}) is not in this torch build's arch list {arch}: kernels may be "
                       "JIT-compiled slowly or missing; install a torch build for this GPU (GB10 is sm_121).")
        if float(g["compute_capability"]) < 8.0:
            out.append(f"{g['name']} has no bf16 tensor cores (compute capability < 8.0): use dtype float16.")
    if not hw["gpus"]:
        out.append("No GPU: CUDA probes are not applicable; memory is measured with the live-bytes tracker.")
        if hw["cpu_architecture"] == "x86-64":
            out.append("bitsandbytes on AVX512-BF16 CPUs repacks 4-bit weights after a no-grad forward and then "
                       "silently cuts gradients; lora_kit applies fix_bnb_cpu_repack to every 4-bit model.")
    if v["bitsandbytes"] is None:
        out.append("bitsandbytes is not installed: QLoRA and 8-bit/paged optimizers are unavailable.")
    failed = [p["name"] for p in probes if p["status"] == "fail"]
    if failed:
        out.append(f"Failed probes: {', '.join(failed)} -- avoid the settings that need them or fix the install.")
    return out


_QLORA = ("method='qlora'", lambda s: s.method == "qlora",
          "use method='lora', or install a bitsandbytes build with kernels for this device")
# probe -> (what in the plan needs it, predicate on Settings, what to change when it fails)
NEEDS = {
    "bf16 matmul": ("dtype='bfloat16' (or autocast)", lambda s: s.dtype == "bfloat16" or (s.autocast and s.dtype != "float16"),
                    "set dtype='float32' (or 'float16' on a GPU) and autocast=False"),
    "bnb 4-bit matmul fwd+bwd": _QLORA,
    "bnb 4-bit grad after eval (raw)": _QLORA,
    "bnb 4-bit grad after eval (kit)": _QLORA,
    "bnb 8-bit optimizer step": ("an 8-bit optimizer", lambda s: s.optimizer in ("adamw_8bit", "paged_adamw_8bit"),
                                 "set optimizer='adamw'"),
    "bnb paged optimizer step": ("a paged optimizer", lambda s: s.optimizer.startswith("paged_"),
                                 "set optimizer='adamw' (or 'adamw_8bit' if its probe passes)"),
    "gradient checkpointing": ("gradient_checkpointing=True", lambda s: s.gradient_checkpointing,
                               "set gradient_checkpointing=False (needs more activation memory: re-check the plan)"),
    "LoRA training step": ("method='lora' or 'qlora'", lambda s: s.method in ("lora", "qlora"),
                           "fix the torch / peft install (see the error), or use method='full'"),
}
# optional libraries (extras), by what uses them: one older than its floor blocks only the plans that do
OPTIONAL_NEEDS = {
    "bitsandbytes": ("QLoRA and the 8-bit / paged optimizers",  # what its probes are needed by
                     lambda s: any(NEEDS[p][1](s) for p in ("bnb 4-bit matmul fwd+bwd", "bnb 8-bit optimizer step",
                                                            "bnb paged optimizer step"))),
    "trl": ("loop='sft' (TRL's SFTTrainer)", lambda s: s.loop == "sft"),
}
# probes no setting requires: what a failure costs instead
FALLBACKS = {"SDPA flash": "PyTorch falls back to another attention kernel (slower; with neither flash nor "
                           "memory-efficient, the math kernel keeps seq_len x seq_len scores: more memory than planned)"}
FALLBACKS["SDPA memory-efficient"] = FALLBACKS["SDPA flash"]
PLAN_FIELDS = ("method", "dtype", "autocast", "optimizer", "gradient_checkpointing", "attn_implementation")


def verdict(probes: list[dict], settings: Settings | None = None, device: str | None = None) -> dict:
    """Does this stack run this plan? The one judge of probe results, used by ``lora-kit check`` and notebook 00.

    A library older than lora_kit declares (:func:`floor_problems`) blocks every plan. A probe the plan needs
    (:data:`NEEDS`) blocks unless it passed or was worked around (``not
    applicable`` blocks too: e.g. QLoRA without bitsandbytes). Other failures and every workaround
    become warnings with their explanation. ``device`` is where the probes ran (this machine's).
    Returns ``{"ok", "blocking": [{probe, status, needed_by, error, change}], "warnings", "plan", "device"}``.
    """
    s = settings if settings is not None else Settings()
    device = device or stack_probes.device().type
    blocking, warnings = [], []
    for f in floor_problems():
        error = f"{f['package']} {f['installed']} is not {f['needs']}, what lora_kit is tested with"
        uses = OPTIONAL_NEEDS.get(f["package"]) if f.get("optional") else None
        if uses is not None and not uses[1](s):  # an optional library this plan does not use
            warnings.append(f"{error}; not needed by this plan: only {uses[0]} needs it ({f['change']}).")
            continue
        blocking.append({"probe": "versions", "status": stack_probes.FAIL,
                         "needed_by": uses[0] if uses is not None else "every step the kit runs", "error": error,
                         "change": f["change"]})
    for p in probes:
        need = NEEDS.get(p["name"])
        needed = need is not None and bool(need[1](s))
        why = p.get("error") or p.get("detail") or ""
        if p["status"] == stack_probes.WORKED_AROUND:
            warnings.append(f"{p['name']}: {why}")
        elif needed and p["status"] in (stack_probes.FAIL, stack_probes.NA):
            blocking.append({"probe": p["name"], "status": p["status"], "needed_by": need[0], "error": why,
                             "change": need[2]})
        elif p["status"] == stack_probes.FAIL:
            uses = f"only {need[0]} needs it" if need else FALLBACKS.get(p["name"], "no setting requires it")
            warnings.append(f"{p['name']} failed ({why}); not needed by this plan: {uses}.")
    scope = (f"this machine's {device}" + ("" if device != "cpu" else
             f"; the planned GPU ({s.gpu}) is not here: run `lora-kit check` with the same settings on it"))
    return {"ok": not blocking, "blocking": blocking, "warnings": warnings, "device": device, "scope": scope,
            "plan": {k: getattr(s, k) for k in PLAN_FIELDS}}


def report(settings: Settings | None = None, probes: bool = True) -> dict:
    """Versions, hardware, probe results, notes and the :func:`verdict` for ``settings`` (default: the
    embedded default plan), as a JSON-ready dict."""
    info = versions()
    for i, g in enumerate(info["hardware"]["gpus"]):
        g.update(cuda_memory(i) or {})
    results = stack_probes.run_all() if probes else []
    return {**info, "probes": results, "notes": notes(info, results),
            "verdict": verdict(results, settings), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def exit_code(rep: dict) -> int:
    """``lora-kit check``'s exit status: 1 when a probe the plan needs failed, else 0 (warnings included)."""
    return 0 if rep["verdict"]["ok"] else 1


def format_verdict(v: dict) -> list[str]:
    plan = ", ".join(f"{k}={val!r}" for k, val in v["plan"].items())
    head = (f"Verdict for {plan} on {v['device']}: "
            + ("OK" if v["ok"] else f"BLOCKED by {len(v['blocking'])} probe(s)")
            + (f", {len(v['warnings'])} warning(s)" if v["warnings"] else ""))
    lines = [head, f"  scope   {v['scope']}"]
    lines += [f"  BLOCKS  {b['probe']} ({b['status']}: {b['error']}); {b['needed_by']} needs it -- {b['change']}."
              for b in v["blocking"]]
    lines += [f"  warning {w}" for w in v["warnings"]]
    return lines


def format_table(rep: dict) -> str:
    """Plain-text table: versions, hardware, probes (status + error text), notes."""
    lines = ["Versions"]
    lines += [f"  {k:<14}{v if v is not None else '-'}" for k, v in rep["versions"].items()]
    hw = rep["hardware"]
    lines += ["Hardware", f"  {'cpu':<14}{hw['cpu_architecture']} ({hw['cpu_count']} cores)", f"  {'os':<14}{hw['os']}"]
    for g in hw["gpus"]:
        lines.append(f"  {'gpu':<14}{g['name']}, compute capability {g['compute_capability']}, "
                     f"{g['memory_bytes'] / 2**30:.1f} GiB"
                     + (f"; CUDA total {g['cuda_total_bytes'] / 2**30:.2f} GiB (the capacity a plan is judged on)"
                        if "cuda_total_bytes" in g else ""))
    if not hw["gpus"]:
        lines.append(f"  {'gpu':<14}none")
    if rep["probes"]:
        w = max(len(p["name"]) for p in rep["probes"]) + 2
        lines.append("Probes")
        for p in rep["probes"]:
            detail = p.get("error") or p.get("detail") or ""
            lines.append(f"  {p['name']:<{w}}{p['status']:<16}{detail}")
    lines.append("Notes")
    lines += [f"  - {n}" for n in rep["notes"]]
    if rep.get("verdict"):
        lines += format_verdict(rep["verdict"])
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(format_table(report()))
