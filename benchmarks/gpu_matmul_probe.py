"""The step-time model's matmuls against CUDA's: LoRA's narrow fp32 matmuls and the base layers' 16-bit ones, timed.

``lora_kit.plan.timing`` times a ``T x k`` by ``k x n`` matmul at its dtype's peak with the output's
``GEMM_TILE``-square tiles run in waves over the SMs (the last wave partly idle). For LoRA's A and B that rule gives
narrow outputs (``n`` = the rank) a small share of the GPU: at 512 tokens and rank 64 one wave holds 4 tiles of 132
SMs. cuBLAS may instead split the long ``k`` over more blocks (split-K, then a reduction kernel), which the model
does not count. Which one CUDA does decides the step time of the held-back H200 rows at few tokens (the QLoRA
paper's 65B step cut to 4 and 8 layers): this probe measures the shapes those steps and the shared rows run.

Per shape and dtype: the median of ``--repeat`` timed products (CUDA events, after warm-ups), the model's time for
the same matmul (:class:`lora_kit.plan.timing._Clock` with the fitted constants, on the catalog row of the GPU it
runs on), their ratio, and the kernels one product launched (``torch.profiler``: a ``splitKreduce`` kernel is
split-K). fp32 runs with TF32 off, as PyTorch's default.

    python benchmarks/gpu_matmul_probe.py --out benchmarks/results/gpu_matmul_probe.json   # on a CUDA GPU
    python benchmarks/gpu_matmul_probe.py --cpu --out /tmp/probe.json   # tiny shapes on the CPU (tests the script)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lora_kit.plan import time_constants as C  # noqa: E402
from lora_kit.plan.gpus import catalog_name, get_gpu  # noqa: E402
from lora_kit.plan.timing import TimeModel, _Clock, fp32_flops, peak_flops  # noqa: E402
from lora_kit.results import write_json_atomic  # noqa: E402


def shapes() -> list[tuple]:
    """(label, T, k, n, dtype): the matmuls of the H200 rows' steps (65B cut: hidden 8192, MLP 22016, rank 64, 512
    tokens; Llama-3.1-8B: 4096, 14336, rank 16, 2,048 and 16,384 tokens), LoRA's in fp32 (forward A and B, and the
    weight gradients, whose long side is the tokens) and the base layers' in bf16."""
    out = []
    for tag, h, m, r, tokens in (("65b", 8192, 22016, 64, (512,)), ("8b", 4096, 14336, 16, (2048, 16384))):
        for T in tokens:
            out += [(f"{tag} lora_A q T{T}", T, h, r, "float32"), (f"{tag} lora_B q T{T}", T, r, h, "float32"),
                    (f"{tag} lora_A down T{T}", T, m, r, "float32"), (f"{tag} lora_B up T{T}", T, r, m, "float32"),
                    (f"{tag} grad A q T{T}", h, T, r, "float32"), (f"{tag} grad B up T{T}", r, T, m, "float32"),
                    (f"{tag} base up T{T}", T, h, m, "bfloat16"), (f"{tag} base q T{T}", T, h, h, "bfloat16")]
    out += [("65b lm_head fp32 T512", 512, 8192, 32000, "float32"),
            ("8b lm_head fp32 T2048", 2048, 4096, 128256, "float32")]
    return out


def cpu_shapes() -> list[tuple]:
    return [("tiny lora_A", 64, 256, 8, "float32"), ("tiny base", 64, 256, 512, "bfloat16")]


def predicted_seconds(gpu: dict, T: int, k: int, n: int, dtype: str) -> float:
    """The model's device time for one matmul (its roofline with the wave rule), host dispatch aside."""
    c = _Clock(gpu, TimeModel())
    peak = fp32_flops(gpu)[0] if dtype == "float32" else peak_flops(gpu, dtype, False)
    b = 4 if dtype == "float32" else 2
    c.matmul("matmul", T, k, n, peak, b, b)
    return c.seconds["matmul"]


def catalog_gpu(device_name: str) -> dict:
    """The catalog row of the GPU torch names (H200, H100 ...), else the H200's (the output names the row used)."""
    return get_gpu(catalog_name(device_name) or "H200")


def time_one(torch, T, k, n, dtype, device, repeat: int) -> tuple[float, list]:
    dt = getattr(torch, dtype)
    a, b = torch.randn(T, k, device=device, dtype=dt), torch.randn(k, n, device=device, dtype=dt)
    for _ in range(3):
        a @ b
    kernels = []
    if device == "cuda":
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            a @ b
            torch.cuda.synchronize()
        kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        times = []
        for _ in range(repeat):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
    else:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return statistics.median(times), kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_matmul_probe.json"))
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (tests the script; no GPU figures)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    import torch
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_matmul_probe: CUDA is not available; nothing measured (--cpu exercises the script).")
        return 0
    device = "cpu" if args.cpu else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default, stated
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    gpu = catalog_gpu(name)
    rows = []
    print(f"{'shape':<26}{'dtype':>9}{'measured us':>13}{'model us':>10}{'model/meas':>11}  kernels")
    for label, T, k, n, dtype in (cpu_shapes() if args.cpu else shapes()):
        meas, kernels = time_one(torch, T, k, n, dtype, device, args.repeat)
        pred = predicted_seconds(gpu, T, k, n, dtype)
        rows.append({"shape": label, "T": T, "k": k, "n": n, "dtype": dtype, "measured_seconds": meas,
                     "model_seconds": pred, "ratio": pred / meas if meas else None, "kernels": kernels,
                     "split_k": any("splitK" in x or "splitk" in x.lower() for x in kernels)})
        print(f"{label:<26}{dtype:>9}{meas * 1e6:>13.1f}{pred * 1e6:>10.1f}{pred / meas:>11.2f}  "
              f"{'; '.join(x[:60] for x in kernels)}", flush=True)
    write_json_atomic(args.out, {"device": name, "catalog_gpu": gpu.get("name"), "torch": torch.__version__,
                                 "gemm_tile": C.GEMM_TILE, "allow_tf32": False, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
