"""A real CPU step against ``simulate``, operator by operator: where do they part, and on which machine?

Both run with ``trace=True``; each gives the storages its operators returned, in order (``allocations``: phase,
operator, bytes). When the real kernels and the fake ones take the same decisions the two sequences are equal item
for item; otherwise the first item where they part names the operator, and the per-operator difference says how
many bytes each side allocated that the other did not. The machine's CPU (model, AVX-512 BF16 / AMX flags, ATen's
CPU capability, threads) and the library versions are printed with it: a kernel whose choice or output depends on
the CPU shows up here, and only on the machine that makes it.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/trace_diff.py     # issue 32's Pythia-1B case (~4 GB RAM, minutes)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/trace_diff.py --model smollm2-135m \
        --step '{"method": "lora", "seq_len": 256}' --out /tmp/diff.json
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/trace_diff.py --paths   # each ATen CPU path in turn (~4 min)

``--paths`` runs the comparison once per kernel path ATen can take on this CPU (its own, then
``ATEN_CPU_CAPABILITY=avx2`` and ``=default``, how CPUs without AVX-512 run), each in a fresh process, and writes
``benchmarks/results/memory_accuracy_cpu_paths.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PYTHIA = dict(method="lora", lora_targets=["query_key_value"], lora_rank=8, seq_len=1024, batch_size=1,
              gradient_checkpointing=False, attn_implementation="sdpa", dtype="bfloat16")


def machine() -> dict:
    import peft
    import torch
    import transformers
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                info.setdefault(key.strip(), val.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name") or platform.processor(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def compare(model: str, step: dict) -> dict:
    from lora_kit.memory.measure import measure_config
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.tracker import first_divergence
    sim = simulate(model, trace=True, **step)
    real = measure_config(model, trace=True, **step)
    return {"model": model, "step": step, "machine": machine(),
            "real": {"peak": real.peak_allocated_bytes, "phase": real.phase, "allocations": len(real.allocations)},
            "simulate": {"peak": sim.peak_allocated_bytes, "phase": sim.phase, "allocations": len(sim.allocations)},
            "first_divergence": first_divergence(real.allocations, sim.allocations)}


PATHS_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_accuracy_cpu_paths.json")


def forced_paths(model: str, step: str | None) -> list[dict]:
    """:func:`compare` in a subprocess per ATen CPU path (this CPU's own, avx2, default)."""
    import subprocess
    import sys
    import tempfile
    rows = []
    for cap in (None, "avx2", "default"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if cap:
            env["ATEN_CPU_CAPABILITY"] = cap
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "diff.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--model", model, "--out", out] + \
                (["--step", step] if step else [])
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"ATEN_CPU_CAPABILITY={cap}: {r.stderr[-2000:]}")
            with open(out) as f:
                rows.append({"forced": cap, **json.load(f)})
        line = next(x for x in r.stdout.splitlines() if x.startswith("real "))
        print(f"ATEN_CPU_CAPABILITY={cap or '(unset)'} ({rows[-1]['machine']['cpu_capability']}): {line}", flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pythia-1b", help="catalog name or model folder (default: pythia-1b)")
    ap.add_argument("--step", default=None, help="step fields as JSON (default: issue 32's Pythia case)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    ap.add_argument("--paths", action="store_true", help="once per ATen CPU path (own, avx2, default); writes "
                    "benchmarks/results/memory_accuracy_cpu_paths.json")
    a = ap.parse_args(argv)
    if a.paths:
        from lora_kit.results import write_json_atomic
        rows = forced_paths(a.model, a.step)
        write_json_atomic(PATHS_OUT, {"paths": rows})
        return {"paths": rows}
    out = compare(a.model, json.loads(a.step) if a.step else PYTHIA)
    print(json.dumps(out["machine"]))
    d = out["real"]["peak"] - out["simulate"]["peak"]
    print(f"real {out['real']['peak']:,} B ({out['real']['phase']})  simulate {out['simulate']['peak']:,} B "
          f"({out['simulate']['phase']})  real - simulate {d:+,} B; allocations {out['real']['allocations']} / "
          f"{out['simulate']['allocations']}")
    div = out["first_divergence"]
    print("allocation sequences equal item for item" if div is None else
          f"first divergence at allocation {div['index']}: real {div['a']} vs simulate {div['b']}\n"
          f"  only in real: {div['only_a']}\n  only in simulate: {div['only_b']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
