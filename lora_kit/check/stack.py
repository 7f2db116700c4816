"""Stack check: exact versions, the hardware, and probes that try the real thing.

A lookup table ("bitsandbytes supports ARM64 since x.y") is not proof: each probe runs the real
operation on this machine's device and reports ``pass``, ``fail`` (with the error text) or
``not applicable`` (with why). The probes take a few seconds on a CPU; they build tiny models from
configs (nothing is downloaded). ``report()`` returns a JSON-ready dict, ``format_table()`` the
table ``lora-kit check`` prints.
"""
from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import time

import torch

from lora_kit.check import probes as stack_probes
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


def report(probes: bool = True) -> dict:
    """Versions, hardware, probe results and notes, as a JSON-ready dict."""
    info = versions()
    results = stack_probes.run_all() if probes else []
    return {**info, "probes": results, "notes": notes(info, results), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def format_table(rep: dict) -> str:
    """Plain-text table: versions, hardware, probes (status + error text), notes."""
    lines = ["Versions"]
    lines += [f"  {k:<14}{v if v is not None else '-'}" for k, v in rep["versions"].items()]
    hw = rep["hardware"]
    lines += ["Hardware", f"  {'cpu':<14}{hw['cpu_architecture']} ({hw['cpu_count']} cores)", f"  {'os':<14}{hw['os']}"]
    for g in hw["gpus"]:
        lines.append(f"  {'gpu':<14}{g['name']}, compute capability {g['compute_capability']}, "
                     f"{g['memory_bytes'] / 2**30:.1f} GiB")
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
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(format_table(report()))
