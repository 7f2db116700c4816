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
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/trace_diff.py --isa --layers 2   # each oneDNN ISA cap, 2 layers
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/trace_diff.py --isa AVX2 --aten avx2 --no-mkldnn

``--paths`` runs the comparison once per kernel path ATen can take on this CPU (its own, then
``ATEN_CPU_CAPABILITY=avx2`` and ``=default``, how CPUs without AVX-512 run), each in a fresh process, and writes
``benchmarks/results/memory_accuracy_cpu_paths.json``. ``--isa`` does the same per oneDNN ISA cap
(``ONEDNN_MAX_CPU_ISA``: how a CPU without AVX512-BF16, or without AVX-512, runs oneDNN; below AVX512_CORE torch
stops sending bf16 matmuls to oneDNN at all), ``--aten`` adds an ATen capability to each of those runs and
``--no-mkldnn`` turns torch's oneDNN use off (``torch.backends.mkldnn.enabled = False``); ``--layers`` cuts the
model to its first N decoder layers (a cheap first look). Each row names the oneDNN ISA in effect and the
kernel a bf16 linear takes there (``onednn``: from ``ONEDNN_VERBOSE`` in a probe process).

Issue 32 (real 3,511,384,064 B vs simulate 3,377,166,336 B elsewhere: 128 MiB) on this machine (AMD EPYC,
AVX512-BF16, no AMX; torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2; OMP_NUM_THREADS=1), every row real ==
simulate byte for byte and the allocation sequences equal item for item:

- full depth (1,312 allocations): 3,377,166,336 B under ATen's own / avx2 / default paths (``--paths``), and
  under ``--isa AVX512_CORE,AVX512_CORE_VNNI --aten avx2`` (ATen AVX2 with oneDNN's own brg_matmul:avx512_core_bf16,
  and with oneDNN capped to gemm:jit:bf16);
- 2 layers (``--layers 2``, 178 allocations): 1,309,155,328 B with oneDNN's own, AVX512_CORE and
  AVX512_CORE_VNNI (gemm:jit:bf16); AVX2 (torch's own bf16 gemm) did not finish in 27 CPU minutes at this width;
- the Pythia-shaped small config of ``tests/test_cpu_paths.py`` (hidden 256, vocab 1,000, 2 layers) at the
  issue's step (seq 1,024), 178 allocations: 26,294,272 B under every ``--isa`` value (own, AVX2, AVX512_CORE,
  AVX512_CORE_VNNI, AVX512_CORE_BF16, AVX512_CORE_AMX: the last two change nothing on this CPU), ``--aten avx2``
  and ``--aten default`` with oneDNN's own and AVX2, and ``--no-mkldnn`` with own / AVX2 / AVX512_CORE.

oneDNN's kernel choice stays inside the matmul: the storages a linear returns, and so the tracked peak, are the
same on every one of these paths. The 128 MiB did not reproduce; run this on the machine that shows it.
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
    return {"cpu": info.get("model name") or platform.processor(), "cpu_family": info.get("cpu family"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def onednn_probe(mkldnn: bool = True) -> dict:
    """oneDNN as this process's environment leaves it (``ONEDNN_MAX_CPU_ISA``): the ISA it runs and the
    implementation of each oneDNN primitive a bf16 linear's forward and backward execute (none: torch ran
    its own kernels), read from ``ONEDNN_VERBOSE`` in a fresh process."""
    import subprocess
    import sys
    code = (f"import torch\ntorch.backends.mkldnn.enabled = {mkldnn!r}\n"
            "x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)\n"
            "w = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)\n"
            "torch.nn.functional.linear(x, w, torch.zeros(32, dtype=torch.bfloat16)).sum().backward()\n")
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False).stdout
    isa = next((ln.split("isa:", 1)[1] for ln in out.splitlines() if ",cpu,isa:" in ln), None)
    kernels = [ln.split(",")[5] + ":" + ln.split(",")[6] for ln in out.splitlines() if ",primitive,exec,cpu," in ln]
    return {"isa": isa, "bf16_linear": kernels}


def compare(model, step: dict, layers: int | None = None, mkldnn: bool = True) -> dict:
    import torch

    from lora_kit.memory.measure import measure_config
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.specs import load_config
    from lora_kit.memory.tracker import first_divergence
    torch.backends.mkldnn.enabled = mkldnn
    name = model
    if layers:
        model = load_config(model)
        model.num_hidden_layers = layers
    sim = simulate(model, trace=True, **step)
    real = measure_config(model, trace=True, **step)
    return {"model": name, "layers": layers, "step": step,
            "machine": {**machine(), "mkldnn_enabled": torch.backends.mkldnn.enabled,
                        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                        "onednn": onednn_probe(mkldnn)},
            "real": {"peak": real.peak_allocated_bytes, "phase": real.phase, "allocations": len(real.allocations)},
            "simulate": {"peak": sim.peak_allocated_bytes, "phase": sim.phase, "allocations": len(sim.allocations)},
            "first_divergence": first_divergence(real.allocations, sim.allocations)}


PATHS_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_accuracy_cpu_paths.json")


ISAS = ("AVX2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_AMX")  # ONEDNN_MAX_CPU_ISA
FORCED = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def forced_paths(model: str, step: str | None, forced=None, layers: int | None = None,
                 mkldnn: bool = True) -> list[dict]:
    """:func:`compare` in a subprocess per forced setting: ``forced`` is a list of {variable: value} (None: this CPU's
    own; default: the ATen CPU paths own, avx2, default). Each row keeps ``forced`` (the ATen capability, for the
    ``--paths`` file) and ``env`` (every variable set)."""
    import subprocess
    import sys
    import tempfile
    rows = []
    for env_set in forced or [{}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "default"}]:
        env = {k: v for k, v in os.environ.items() if k not in FORCED}
        env.update({k: v for k, v in env_set.items() if v})
        label = " ".join(f"{k}={v}" for k, v in env_set.items() if v) or "(own)"
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "diff.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--model", model, "--out", out] + \
                (["--step", step] if step else []) + (["--layers", str(layers)] if layers else []) + \
                ([] if mkldnn else ["--no-mkldnn"])
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{label}: {r.stderr[-2000:]}")
            with open(out) as f:
                rows.append({"forced": env_set.get("ATEN_CPU_CAPABILITY"), "env": env_set, **json.load(f)})
        m = rows[-1]["machine"]
        line = next(x for x in r.stdout.splitlines() if x.startswith("real "))
        print(f"{label}{'' if mkldnn else ' mkldnn off'} (ATen {m['cpu_capability']}, "
              f"oneDNN {m['onednn']['isa'] or 'not used'}, "
              f"bf16 linear {'/'.join(m['onednn']['bf16_linear']) or 'torch kernels'}): {line}", flush=True)
        div = rows[-1]["first_divergence"]
        if div is not None:
            print(f"  first divergence at allocation {div['index']}: real {div['a']} vs simulate {div['b']}\n"
                  f"  only in real: {div['only_a']}\n  only in simulate: {div['only_b']}", flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pythia-1b", help="catalog name or model folder (default: pythia-1b)")
    ap.add_argument("--step", default=None, help="step fields as JSON (default: issue 32's Pythia case)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    ap.add_argument("--paths", action="store_true", help="once per ATen CPU path (own, avx2, default); writes "
                    "benchmarks/results/memory_accuracy_cpu_paths.json")
    ap.add_argument("--isa", nargs="?", const=",".join(ISAS), default=None,
                    help="once per ONEDNN_MAX_CPU_ISA (comma-separated; default: " + ", ".join(ISAS) + "), "
                    "after this CPU's own; each in a fresh process (written to --out when given)")
    ap.add_argument("--aten", default=None, help="with --isa: ATEN_CPU_CAPABILITY for every run (avx2, default)")
    ap.add_argument("--no-mkldnn", action="store_true", help="torch.backends.mkldnn.enabled = False")
    ap.add_argument("--layers", type=int, default=None, help="only the first N decoder layers (a cheaper look)")
    a = ap.parse_args(argv)
    if a.paths and (a.isa or a.aten):
        ap.error("--paths runs the ATen paths; --isa (with --aten) the oneDNN caps: one at a time")
    if a.paths or a.isa:
        from lora_kit.results import write_json_atomic
        forced = None if not a.isa else [{"ATEN_CPU_CAPABILITY": a.aten, "ONEDNN_MAX_CPU_ISA": v}
                                          for v in [None] + a.isa.split(",")]
        rows = forced_paths(a.model, a.step, forced, a.layers, not a.no_mkldnn)
        if a.paths and not a.layers and not a.no_mkldnn:  # only the full-depth default figures go there
            write_json_atomic(PATHS_OUT, {"paths": rows})
        if a.out:
            write_json_atomic(a.out, {"paths": rows})
        return {"paths": rows}
    out = compare(a.model, json.loads(a.step) if a.step else PYTHIA, a.layers, not a.no_mkldnn)
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
