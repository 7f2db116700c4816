#!/usr/bin/env python
"""The Python steps of a one-call GPU session (``scripts/gpu_session.sh``) and of preparing its wheels
(``scripts/gpu_wheels.sh``). Each subcommand is one step and exits 0 when it did what it could: what failed is
written into its output, so one failure never hides the next step's results.

    python scripts/gpu_session.py env --out env.json            # versions, GPU, memory, carried wheels' needs
    python scripts/gpu_session.py wheels-check .whl             # one version each; every need carried or assumed
    python scripts/gpu_session.py fits .whl/fits                # the memory-model fits the session would make
    python scripts/gpu_session.py smoke --runs-dir /tmp/s --out /tmp/o [--cpu]   # lora-kit run on random weights

The GPU machine has PyTorch, transformers and the common scientific stack but not the notebook stack or
bitsandbytes; :data:`ASSUMED_ON_DEVICE` names what the carried wheels take from it (the device's package list,
read on 2026-11-17); ``env`` checks those versions there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# installed on the GPU machine (its package list), needed by the carried wheels or by lora_kit
ASSUMED_ON_DEVICE = ("accelerate", "aiohttp", "attrs", "click", "huggingface-hub", "jinja2", "markupsafe", "narwhals",
                     "numpy", "packaging", "pandas", "psutil", "pygments", "python-dateutil", "pyyaml", "regex",
                     "requests", "safetensors", "tokenizers", "torch", "tqdm", "typer", "typing-extensions")
# the environment Requires-Dist markers are read in: the GPU machine's python3
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
# the smoke run: a real model's shapes (qwen2.5-0.5b, random weights), QLoRA, the embedded dates data
SMOKE_MODEL = "qwen2.5-0.5b"
SMOKE = {"gpu": dict(notebooks=["00", "03", "04"], dtype="bfloat16", seq_len=1024, batch_size=4,
                     gradient_checkpointing=True, max_steps=20, eval_examples=32, control_examples=32),
         "cpu": dict(notebooks=["00", "03"], dtype="float32", seq_len=64, batch_size=2,
                     gradient_checkpointing=False, max_steps=2, eval_examples=8, control_examples=8)}
SMOKE_COMMON = dict(method="qlora", compare_base_mix=0)
KEEP_OUT_OF_PACK = ("plotly.min.js", ".safetensors", ".bin", ".pt")  # large, and not results


def _now() -> str:
    return time.strftime("%H:%M:%S")


def _requirements(meta: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]


# ----------------------------------------------------------------------------------------------
# env: what the session ran on
# ----------------------------------------------------------------------------------------------
def _try(out: dict, key: str, fn):
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded: the rest of the environment still gets read
        out[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def nvidia_smi() -> dict:
    fields = "name,driver_version,memory.total,memory.used,memory.free"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    rows = [dict(zip(fields.split(","), (v.strip() for v in line.split(",")))) for line in r.stdout.splitlines()]
    return {"rc": r.returncode, "gpus": rows, "memory_unit": "MiB", "stderr": r.stderr[-500:]}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, distribution
    out = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "huggingface-hub", "tokenizers",
                 "safetensors", "numpy", "pandas", "papermill", "nbclient", "ipykernel", "plotly", "ipywidgets",
                 "triton"):
        try:
            d = distribution(name)
            out[name] = {"version": d.version, "at": str(d.locate_file(""))}
        except PackageNotFoundError:
            out[name] = None
    return out


def torch_cuda() -> dict:
    import torch
    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "available": torch.cuda.is_available()}
    if out["available"]:
        p = torch.cuda.get_device_properties(0)
        free0, total0 = torch.cuda.mem_get_info()  # the context exists now: what it and the driver took
        torch.ones(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        out.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                   total_memory=p.total_memory, l2_cache_bytes=getattr(p, "L2_cache_size", None),
                   mem_get_info={"free": free, "total": total, "free_before_first_tensor": free0})
        from lora_kit.check.stack import cuda_memory
        out["cuda_memory"] = cuda_memory()
    return out


def bnb_library() -> dict:
    import bitsandbytes
    from bitsandbytes import cextension
    lib = getattr(cextension, "lib", None)
    return {"version": bitsandbytes.__version__, "backend": getattr(cextension, "BNB_BACKEND", None),
            "library": str(getattr(lib, "_name", None) or getattr(getattr(lib, "lib", None), "_name", None)),
            "shipped": sorted(p.name for p in Path(bitsandbytes.__file__).parent.glob("libbitsandbytes_*"))}


def carried_needs(site: str) -> dict:
    """Every Requires-Dist of the packages installed under ``site`` (the carried wheels; a need's extras followed),
    checked against what this Python finds installed: unmet ones listed, and the versions of
    :data:`ASSUMED_ON_DEVICE`."""
    from importlib.metadata import PackageNotFoundError, distribution, distributions, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    unmet, checked = [], 0
    todo, seen = [(d, "") for d in distributions(path=[site])], set()
    while todo:
        d, extra = todo.pop()
        if (d.metadata["Name"], extra) in seen:
            continue
        seen.add((d.metadata["Name"], extra))
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker and not req.marker.evaluate({"extra": extra}):
                continue
            if extra and not (req.marker and "extra" in str(req.marker)):
                continue
            checked += 1
            try:
                have = version(req.name)
            except PackageNotFoundError:
                unmet.append(f"{d.metadata['Name']}: {req} (not installed)")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{d.metadata['Name']}: {req} (installed {have})")
            todo += [(distribution(req.name), e) for e in req.extras]
    assumed = {}
    for name in ASSUMED_ON_DEVICE:
        try:
            assumed[canonicalize_name(name)] = version(name)
        except PackageNotFoundError:
            assumed[canonicalize_name(name)] = None
    return {"site": site, "requirements_checked": checked, "unmet": unmet, "assumed_on_device": assumed}


def cmd_env(a) -> int:
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTHONPATH", "JUPYTER_PATH", "HOME", "LORA_KIT_FITS",
             "CUDA_VISIBLE_DEVICES")
    out: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "cpus": os.cpu_count(),
                 "environ": {k: os.environ.get(k) for k in names}}
    _try(out, "nvidia_smi", nvidia_smi)
    _try(out, "versions", versions)
    _try(out, "torch_cuda", torch_cuda)
    _try(out, "bitsandbytes", bnb_library)
    if a.site:
        _try(out, "carried_needs", lambda: carried_needs(a.site))
    _try(out, "disk_tmp_free", lambda: shutil.disk_usage("/tmp").free)
    _try(out, "memory", lambda: dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines()[:3]))
    Path(a.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    cuda = out.get("torch_cuda") or {}
    print(f"{_now()} env: {cuda.get('name', 'no CUDA')} torch {cuda.get('torch')} (cuda {cuda.get('cuda_build')}); "
          f"unmet needs: {(out.get('carried_needs') or {}).get('unmet', 'n/a')}; -> {a.out}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# wheels-check: the carried set is whole (here, before the session)
# ----------------------------------------------------------------------------------------------
def wheel_needs(folder: str | Path) -> tuple[dict, list[str]]:
    """({name: version} of the wheels in ``folder``, problems): two versions of one package, or a need (markers read
    for the GPU machine's python3, a need's extras followed) that no wheel there meets and that is not in
    :data:`ASSUMED_ON_DEVICE`."""
    import zipfile
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
        from packaging.version import Version
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
        from pip._vendor.packaging.version import Version
    have, reqs, problems = {}, {}, []
    for w in sorted(Path(folder).glob("*.whl")):
        with zipfile.ZipFile(w) as z:  # the wheel's own METADATA, not a vendored package's
            meta = z.read(next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))).decode()
        head = dict(line.split(": ", 1) for line in meta.splitlines() if re.match(r"^(Name|Version): ", line))
        name = canonicalize_name(head["Name"])
        if name in have:
            problems.append(f"two versions of {name}: {have[name]} and {head['Version']}")
        have[name], reqs[name] = head["Version"], [Requirement(r) for r in _requirements(meta)]
    assumed = {canonicalize_name(n) for n in ASSUMED_ON_DEVICE}
    todo, seen = [(name, "") for name in have], set()
    while todo:
        owner, extra = todo.pop()
        if (owner, extra) in seen:
            continue
        seen.add((owner, extra))
        for req in reqs[owner]:
            if req.marker and not req.marker.evaluate({**DEVICE_MARKERS, "extra": extra}):
                continue
            if extra and not (req.marker and "extra" in str(req.marker)):
                continue  # a need of the package itself, met or not already
            dep = canonicalize_name(req.name)
            if dep in have:
                if req.specifier and not req.specifier.contains(Version(have[dep]), prereleases=True):
                    problems.append(f"{owner} needs {req}, carried {dep} {have[dep]}")
                todo += [(dep, e) for e in req.extras]
            elif dep not in assumed:
                problems.append(f"{owner}{f'[{extra}]' if extra else ''} needs {req}: neither carried nor assumed "
                                "on the device")
    return have, problems


def cmd_wheels_check(a) -> int:
    have, problems = wheel_needs(a.folder)
    kit = {"torch", "transformers", "peft", "accelerate", "safetensors", "tokenizers", "numpy", "pandas", "plotly",
           "ipywidgets", "anywidget", "papermill", "nbconvert", "ipykernel", "pyyaml", "tqdm", "bitsandbytes"}
    assumed = {n.replace("_", "-") for n in ASSUMED_ON_DEVICE}
    problems += [f"lora_kit needs {n}: neither carried nor assumed on the device"
                 for n in sorted(kit - set(have) - assumed)]
    print(f"{len(have)} wheels in {a.folder}; " + ("every need met (carried, or assumed on the device)" if not problems
                                                    else f"{len(problems)} problem(s):"))
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


# ----------------------------------------------------------------------------------------------
# fits: what estimate would fit on the spot in the session, made here once
# ----------------------------------------------------------------------------------------------
def smoke_settings(kind: str, model: str, gpu: str = "") -> dict:
    """The smoke run's settings (``kind``: "gpu" or "cpu") over ``lora-kit run``'s defaults."""
    s = {**SMOKE_COMMON, **{k: v for k, v in SMOKE[kind].items() if k != "notebooks"}, "model": model}
    return {**s, "gpu": gpu} if gpu else s


def smoke_flags(kind: str, model: str, gpu: str = "") -> list[str]:
    """:func:`smoke_settings` as ``lora-kit run`` flags."""
    flags = []
    for k, v in smoke_settings(kind, model, gpu).items():
        flags += ["--" + k.replace("_", "-"), str(v).lower() if isinstance(v, bool) else str(v)]
    return flags


def cmd_fits(a) -> int:
    """Fill ``a.dir`` (``LORA_KIT_FITS``) with every fit ``benchmarks/gpu_validate.py`` and the smoke runs' estimates
    miss among the shipped ones (same code and transformers as the session: the keys match)."""
    import tempfile
    os.environ["LORA_KIT_FITS"] = str(Path(a.dir).resolve())
    os.environ["LORA_KIT_FIT"] = "auto"
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_validate
    t0 = time.perf_counter()
    for label, model, kw in gpu_validate.GPU_CONFIGS + gpu_validate.cut_gpu_configs():
        _, why = gpu_validate._estimate(model, kw)
        print(f"{_now()} fits: {label} {why or 'ok'}", flush=True)
    from lora_kit.memory.estimate import estimate
    from lora_kit.settings import load_settings
    for kind in SMOKE:
        with tempfile.TemporaryDirectory() as d:
            build_model(d, kind, config_only=True)
            s = load_settings(None, smoke_settings(kind, d))  # as lora-kit run makes them from its flags
            estimate(s.model, s.step)
            print(f"{_now()} fits: smoke run ({kind}) ok", flush=True)
    made = sorted(p.name for p in Path(a.dir).glob("*.json.gz"))
    print(f"{len(made)} fit(s) in {a.dir} ({time.perf_counter() - t0:.0f} s)")
    return 0


# ----------------------------------------------------------------------------------------------
# smoke: lora-kit run on a real model's shapes with random weights
# ----------------------------------------------------------------------------------------------
def build_model(folder: str | Path, kind: str, config_only: bool = False) -> None:
    """The smoke run's model folder: :data:`SMOKE_MODEL`'s shapes, random weights (``scripts/random_model.py``)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import random_model
    random_model.build(SMOKE_MODEL, folder, SMOKE[kind]["dtype"], "cuda" if kind == "gpu" else "cpu",
                       config_only=config_only)


def plan_gpu(smi_name: str) -> str:
    """The plan's GPU from nvidia-smi's name (lora_kit.plan.gpus.catalog_name); a card not in the catalog plans for
    an A100-80GB."""
    from lora_kit.plan.gpus import catalog_name
    return catalog_name(smi_name) or "A100-80GB"


def _gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _run(cmd: list[str], timeout: float, log) -> int:
    """``cmd`` with its output in ``log``; at ``timeout`` it gets SIGTERM (lora-kit stops its kernel, records
    "interrupted" and builds its card), 25 s later SIGKILL. It stays in this process group, so the session's
    timeout(1) ends whatever it leaves. Returns its exit status (124 after a timeout, as timeout(1))."""
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        return p.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=25)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        return 124


def pack(run_dir: Path, tar_path: Path, extra: list[Path] = ()) -> int:
    """The run folder's results (JSON, logs, run card, executed notebooks and their HTML) in one tar.gz, without the
    adapter weights and the plotly bundle. Returns the number of files packed."""
    n = 0
    with tarfile.open(tar_path, "w:gz") as tar:
        for f in sorted(run_dir.rglob("*")) if run_dir.is_dir() else []:
            if f.is_file() and not any(f.name.endswith(k) for k in KEEP_OUT_OF_PACK):
                tar.add(f, arcname=str(Path(run_dir.name) / f.relative_to(run_dir)))
                n += 1
        for f in extra:
            if f.is_file():
                tar.add(f, arcname=str(Path(run_dir.name) / f.name))
                n += 1
    return n


def cmd_smoke(a) -> int:
    kind = "cpu" if a.cpu else "gpu"
    t0, deadline = time.perf_counter(), time.perf_counter() + a.timeout
    runs, out = Path(a.runs_dir), Path(a.out)
    runs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log_path = runs / "smoke_session.log"
    model = runs / "model"
    status = {"kind": kind, "model": SMOKE_MODEL}
    with open(log_path, "a") as log:
        build = [sys.executable, str(REPO / "scripts" / "random_model.py"), SMOKE_MODEL, str(model),
                 "--dtype", SMOKE[kind]["dtype"], "--device", "cuda" if kind == "gpu" else "cpu"]
        log.write(f"{_now()} $ {' '.join(build)}\n")
        log.flush()
        status["build_rc"] = _run(build, min(120.0, deadline - time.perf_counter()), log)  # its own process: its
        status["build_seconds"] = round(time.perf_counter() - t0, 1)  # CUDA context is gone before the run
        print(f"{_now()} smoke: model built (rc {status['build_rc']}, {status['build_seconds']} s)", flush=True)
        if status["build_rc"] == 0:
            gpu = plan_gpu(_gpu_name()) if kind == "gpu" else ""
            run = [sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(runs), "--name", "smoke",
                   "--only", *(a.notebooks or SMOKE[kind]["notebooks"]), *smoke_flags(kind, str(model), gpu)]
            log.write(f"{_now()} $ {' '.join(run)}\n")
            log.flush()
            t1 = time.perf_counter()
            status["run_rc"] = _run(run, deadline - time.perf_counter() - 15, log)  # 15 s left to pack
            status["run_seconds"] = round(time.perf_counter() - t1, 1)
            print(f"{_now()} smoke: lora-kit run rc {status['run_rc']} in {status['run_seconds']} s", flush=True)
    print("".join(log_path.read_text(errors="replace").splitlines(True)[-15:]), end="", flush=True)  # its end
    status_path = runs / "smoke_status.json"
    status_path.write_text(json.dumps(status, indent=1) + "\n")
    n = pack(runs / "smoke", out / "smoke_run.tar.gz", [log_path, status_path])
    print(f"{_now()} smoke: {n} files -> {out / 'smoke_run.tar.gz'}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="versions, GPU and memory as JSON")
    e.add_argument("--out", required=True)
    e.add_argument("--site", default="", help="folder of the carried packages, whose needs are checked")
    w = sub.add_parser("wheels-check", help="the carried wheels: one version each, every need met")
    w.add_argument("folder")
    f = sub.add_parser("fits", help="make the memory-model fits the session would make, into this folder")
    f.add_argument("dir")
    s = sub.add_parser("smoke", help="lora-kit run on a random-weight model; results packed into --out")
    s.add_argument("--runs-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--cpu", action="store_true", help="the CPU check: tiny steps, float32, notebooks 00 and 03")
    s.add_argument("--timeout", type=float, default=170.0, help="seconds for the whole step, packing included")
    s.add_argument("--notebooks", nargs="+", help="notebook prefixes to run instead of the kind's (SMOKE)")
    a = p.parse_args(argv)
    return {"env": cmd_env, "wheels-check": cmd_wheels_check, "fits": cmd_fits, "smoke": cmd_smoke}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
