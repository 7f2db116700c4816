"""The GPU catalog: memory, bandwidth, dense tensor-core TFLOP/s, architecture, host CPU, interconnect
(named, and its GB/s per direction: ``interconnect_gbs``, what the multi-GPU plan divides traffic by).

The data lives in ``lora_kit/catalog/gpus.csv`` (one row per GPU, the vendor datasheet named in
``source``). Users extend it with their own CSV (``gpu_table(extra_csv=...)``) or one row at a time
(:func:`add_gpu`); a user row with a known name replaces the shipped one.

Capacity, honestly: vendors write "80 GB" but CUDA sees a different number (an A100 80GB reports
81,920 MiB = 80 GiB; an H100 80GB 81,559 MiB; an L4 "24 GB" 23,034 MiB). ``capacity_bytes`` is nvidia-smi's
total, shown; the planner compares with ``(1 - margin) * cuda_capacity_bytes``. It is ``cuda_total_mib`` * 2**20
where a public report is named in the row, else ``memory_gb`` * 1e9 (the smaller reading of the vendor's GB).

What CUDA can hand out is less than nvidia-smi's total: the driver keeps a share no process can use (H200:
nvidia-smi 143,771 MiB, CUDA 143,156 MiB, measured in ``benchmarks/reference/cuda_h200.json``), and the CUDA context
takes its bytes from the CUDA total. ``cuda_capacity_bytes`` is the CUDA total (``cuda_visible_bytes``, the reading
named in ``cuda_visible_source``; ``memory_gb`` * 1e9 where none is named, and ``cuda_capacity_basis`` says which);
``context_bytes`` the CUDA context (``cuda_context_bytes``, else the ``CUDA_CONTEXT_BYTES`` default, said in
``context_basis``); ``driver_share_bytes`` nvidia-smi's total minus CUDA's where both are known. On the machine,
``lora_kit.check.stack.cuda_memory`` reads the CUDA total itself.

Speed: ``bf16_tflops`` / ``fp16_tflops`` are dense tensor-core peaks; ``fp32_tflops`` (FP32 on CUDA cores, where
fp32 matmuls run with TF32 off) and ``l2_mb`` (the L2 cache), sourced in ``fp32_l2_source``, are what the time
model (:mod:`lora_kit.plan.timing`) reads, before its own tables; ``add_gpu(..., fp32_tflops=, l2_mb=)`` sets them.

Prices: ``example_price_per_hour`` is an example to show how cost is computed, never a quote; the
planner takes the user's own ``prices={"H100-SXM": ...}``.
"""
from __future__ import annotations

import difflib

import re
from pathlib import Path

import pandas as pd

from lora_kit.memory.device import CUDA_CONTEXT_BYTES

CATALOG_CSV = Path(__file__).parents[1] / "catalog" / "gpus.csv"
COLUMNS = ("name", "memory_gb", "memory_type", "cuda_total_mib", "cuda_total_source", "cuda_visible_bytes",
           "cuda_visible_source", "cuda_context_bytes", "cuda_context_source", "memory_bandwidth_gbs",
           "bf16_tflops", "fp16_tflops", "fp32_tflops", "l2_mb", "fp32_l2_source", "architecture",
           "compute_capability", "cpu_arch", "interconnect", "interconnect_gbs", "source", "example_price_per_hour",
           "notes")
REQUIRED = ("name", "memory_gb", "memory_bandwidth_gbs")
NUMERIC = ("memory_gb", "cuda_total_mib", "cuda_visible_bytes", "cuda_context_bytes", "memory_bandwidth_gbs",
           "bf16_tflops", "fp16_tflops", "fp32_tflops", "l2_mb", "interconnect_gbs", "example_price_per_hour")
FALLBACK_CAPACITY = "fallback: vendor GB x 1e9 (no CUDA reading named)"
FALLBACK_CONTEXT = "fallback: lora_kit.memory.device.CUDA_CONTEXT_BYTES (the H200's measured context, a stated default)"
_USER_ROWS: dict[str, dict] = {}  # key -> row added with add_gpu (this Python session only)
_CACHE: dict = {}


def _key(name: str) -> str:
    """Lookup key: case and punctuation insensitive ("a100 80gb" == "A100-80GB")."""
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


def _read_csv(path) -> pd.DataFrame:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GPU catalog file {str(p)!r} does not exist.")
    try:
        df = pd.read_csv(p, comment="#", skipinitialspace=True)
    except Exception as e:  # pandas raises several parser errors
        raise ValueError(f"GPU catalog file {str(p)!r} is not a readable CSV: {e}") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"GPU catalog file {str(p)!r} lacks column(s) {missing}; it has {list(df.columns)}. "
                         f"Columns understood: {', '.join(COLUMNS)}.")
    return df


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    df = df.reindex(columns=list(COLUMNS) + [c for c in df.columns if c not in COLUMNS])
    for c in NUMERIC:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    for c in ("memory_gb", "memory_bandwidth_gbs"):
        bad = df.loc[~(df[c] > 0), "name"].tolist()
        if bad:
            raise ValueError(f"GPU(s) {bad}: {c} must be a positive number.")
    raw = df["compute_capability"]
    cc = pd.to_numeric(raw, errors="coerce")
    bad = df.loc[(raw.notna() & raw.astype(str).str.strip().ne("") & cc.isna()) | (cc <= 0), "name"].tolist()
    if bad:
        raise ValueError(f"GPU(s) {bad}: compute_capability must be a number such as 8.9 or 9.0 (leave it empty if "
                         "unknown).")
    df["compute_capability"] = cc.astype(float)
    for c in ("fp32_tflops", "l2_mb"):  # optional: empty is unknown, a number must be positive
        bad = df.loc[df[c] <= 0, "name"].tolist()
        if bad:
            raise ValueError(f"GPU(s) {bad}: {c} must be a positive number (leave it empty if unknown).")
    neg = df.loc[df["example_price_per_hour"] < 0, "name"].tolist()
    if neg:
        raise ValueError(f"GPU(s) {neg}: example_price_per_hour must be >= 0 (leave it empty if unknown).")
    df["capacity_bytes"] = df["cuda_total_mib"].mul(2 ** 20).fillna(df["memory_gb"] * 1e9).astype("int64")
    df["capacity_gib"] = df["capacity_bytes"] / 2 ** 30
    df["memory_bytes"] = df["capacity_bytes"]  # alias (the CLI reads it)
    seen = df["cuda_visible_bytes"].notna()
    df["cuda_capacity_bytes"] = df["cuda_visible_bytes"].fillna(df["memory_gb"] * 1e9).astype("int64")
    df["cuda_capacity_basis"] = seen.map({True: "CUDA total (cuda_visible_source)", False: FALLBACK_CAPACITY})
    ctx = df["cuda_context_bytes"].notna()
    df["context_bytes"] = df["cuda_context_bytes"].fillna(CUDA_CONTEXT_BYTES).astype("int64")
    df["context_basis"] = ctx.map({True: "measured (cuda_context_source)", False: FALLBACK_CONTEXT})
    df["driver_share_bytes"] = df["cuda_total_mib"] * 2 ** 20 - df["cuda_visible_bytes"]  # NaN unless both known
    df["key"] = df["name"].map(_key)
    return df.drop_duplicates("key", keep="last").set_index("name", drop=False)


def gpu_table(extra_csv: str | Path | None = None) -> pd.DataFrame:
    """The catalog as a DataFrame indexed by GPU name (shipped rows, then ``extra_csv``, then add_gpu rows).

    Adds ``capacity_bytes`` / ``capacity_gib`` (nvidia-smi's total, shown) and ``cuda_capacity_bytes`` (what the
    planner compares against), see the module doc.
    """
    ck = str(extra_csv)
    if ck not in _CACHE:
        frames = [_read_csv(CATALOG_CSV)]
        if extra_csv is not None:
            frames.append(_read_csv(extra_csv))
        if _USER_ROWS:
            frames.append(pd.DataFrame(list(_USER_ROWS.values())))
        _CACHE.clear()
        df = _finish(pd.concat(frames, ignore_index=True))
        _CACHE[ck] = (df, {k: row for k, row in zip(df["key"], df.to_dict("records"))})
    return _CACHE[ck][0].copy()


def add_gpu(name: str, memory_gb: float, memory_bandwidth_gbs: float, bf16_tflops: float | None = None,
            **fields) -> dict:
    """Add (or replace) a GPU for this Python session; returns the row as the planner will see it.

    Example: ``add_gpu("RTX-5090", memory_gb=32, memory_bandwidth_gbs=1792, bf16_tflops=209.5,
    source="NVIDIA RTX Blackwell whitepaper", cpu_arch="x86-64")``. Unknown field names raise.
    """
    unknown = sorted(set(fields) - set(COLUMNS))
    if unknown:
        raise ValueError(f"add_gpu: unknown field(s) {unknown}; known fields: {', '.join(COLUMNS)}.")
    row = {"name": name, "memory_gb": memory_gb, "memory_bandwidth_gbs": memory_bandwidth_gbs,
           "bf16_tflops": bf16_tflops, **fields}
    _finish(pd.DataFrame([row]))  # validate before registering
    _USER_ROWS[_key(name)] = row
    _CACHE.clear()
    return get_gpu(name)


def remove_user_gpus() -> None:
    """Forget every add_gpu row (tests use it; the shipped catalog is untouched)."""
    _USER_ROWS.clear()
    _CACHE.clear()


def known_gpus(extra_csv=None) -> list[str]:
    return gpu_table(extra_csv)["name"].tolist()


def get_gpu(name: str, extra_csv=None) -> dict:
    """One catalog row as a dict; an unknown name raises ValueError listing the known ones."""
    gpu_table(extra_csv)  # fills the cache
    rows = _CACHE[str(extra_csv)][1]
    if _key(name) not in rows:
        names = [r["name"] for r in rows.values()]
        like = [n for n in names if _key(name) and _key(name) in _key(n)] or \
            difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, like[:3]))}?" if like else ""
        raise ValueError(f"Unknown GPU {name!r}.{hint} Known GPUs: {', '.join(names)}. "
                         "Add yours with lora_kit.plan.gpus.add_gpu(...) or gpu_table(extra_csv=...).")
    return dict(rows[_key(name)])


# what torch.cuda.get_device_name() / nvidia-smi call a catalog GPU: (text in the device's name, catalog name), the
# first match wins (the more specific first)
DEVICE_NAMES = (("H200", "H200"), ("H100 PCIE", "H100-PCIe"), ("H100", "H100-SXM"), ("A100-SXM4-40GB", "A100-40GB"),
                ("A100-PCIE-40GB", "A100-40GB"), ("A100", "A100-80GB"), ("L40S", "L40S"),
                ("RTX 6000 ADA", "RTX-6000-Ada"), ("RTX 4090", "RTX-4090"), ("A10G", "A10G"), ("L4", "L4"),
                ("T4", "T4"), ("B200", "B200"), ("GB10", "GB10"))


def catalog_name(device_name: str) -> str | None:
    """The catalog GPU a device is (``torch.cuda.get_device_name()``'s or nvidia-smi's name: "NVIDIA H100 80GB
    HBM3" -> "H100-SXM"), or None for a card the catalog does not hold."""
    up = str(device_name).upper()
    return next((name for key, name in DEVICE_NAMES if key in up), None)


def compute_capability(gpu, unknown: float | None = None) -> float | None:
    """The CUDA compute capability of ``gpu`` (a catalog name or :func:`get_gpu`'s row), ``unknown`` where the catalog
    has none. Callers name their own ``unknown``: the attention rules assume 8.0 (a card with flash attention), the
    cuBLAS workspace takes None (its larger size, ``lora_kit.memory.device``)."""
    row = get_gpu(gpu) if isinstance(gpu, str) else gpu
    cc = row.get("compute_capability")
    try:
        v = float(cc) if not isinstance(cc, bool) else None
    except (TypeError, ValueError):  # None, or a row dict of the caller's own with text in it
        v = None
    return v if v is not None and v == v and v > 0 else unknown


BF16_FROM = 8.0  # bf16 tensor cores, and torch.cuda.is_bf16_supported(including_emulation=False): Ampere (sm80) on
FLASH_ATTENTION_2_FROM = 8.0  # flash-attn 2's kernels: Ampere (sm80) and newer (Turing had flash-attn 1 only)


def has_bf16(gpu) -> bool:
    """Whether ``gpu`` (a catalog name or row) computes in bf16: compute capability >= :data:`BF16_FROM`. Below it
    (the catalog's T4, a V100) torch says bf16 is unsupported without emulation and HF Trainer refuses
    ``bf16=True``; a card without a compute capability in its row is taken to have it."""
    return compute_capability(gpu, unknown=BF16_FROM) >= BF16_FROM


def gpu_problems(gpu, step=None, **overrides) -> list[str]:
    """What ``step`` (a ``lora_kit.settings.Step``, default ``PLANNING``, with ``overrides``) asks of ``gpu`` (a
    catalog name or row) that the card cannot run, one sentence each with the fix; [] when it runs (or the row has no
    compute capability). The kit's one rule for it: a step that computes in bf16 (``dtype='bfloat16'``, autocast over
    fp32 weights, QLoRA's bf16 adapters under ``qlora_prepare='none'``) needs :func:`has_bf16`;
    ``attn_implementation='flash_attention_2'`` needs :data:`FLASH_ATTENTION_2_FROM`. Memory is judged apart (the
    fit verdict): bf16 and fp16 are both 2 bytes, so the estimate of a bf16 step holds for the fp16 one."""
    from lora_kit.settings import as_step
    row = get_gpu(gpu) if isinstance(gpu, str) else gpu
    cc, name = compute_capability(row), row.get("name", "this GPU")
    st = as_step(step, **overrides)
    if cc is None:
        return []
    out = []

    def in_bf16(s) -> list[str]:
        d = s.part_dtypes  # the dtype each part of the step runs in (one definition)
        return [k for k in ("base", "head", "activations", "adapters") if d[k] == "bfloat16"]

    parts = in_bf16(st)
    if cc < BF16_FROM and parts:
        what, fix = [], []
        if parts != ["adapters"]:
            what.append("dtype='bfloat16'" if st.dtype == "bfloat16" else "autocast over float32 weights, in bf16")
            fix.append("plan dtype='float16'" + (" (the memory estimate stays: bf16 and fp16 are both 2 bytes)"
                                                 if st.dtype == "bfloat16" else " (16-bit weights: estimate again)"))
        if in_bf16(st.replace(dtype="float16")):  # QLoRA without peft's up-casts keeps bf16 adapters
            what.append("qlora_prepare='none' (bf16 LoRA adapters)")
            fix.append("qlora_prepare='peft' (fp32 adapters)")
        out.append(f"{name} has no bf16 (compute capability {cc:.1f}; bf16 needs {BF16_FROM:.1f}, Ampere, or newer, "
                   f"and HF Trainer refuses bf16=True below it) and this step runs {' and '.join(what)}: "
                   + " and ".join(fix))
    if cc < FLASH_ATTENTION_2_FROM and st.attn_implementation == "flash_attention_2":
        fix = "use attn_implementation='sdpa'"
        if st.padding == "packed":
            fix += " and padding='max_length' (padding-free packed rows need flash_attention_2)"
        out.append(f"flash_attention_2 needs compute capability {FLASH_ATTENTION_2_FROM:.1f} (Ampere) or newer; the "
                   f"{name} is {cc:.1f}: {fix}")
    return out


def resolve_prices(names, prices: dict | None = None, extra_csv=None) -> dict[str, float]:
    """Price per hour for each GPU: the user's ``prices`` where given, else the catalog's example (NaN if none).

    Negative prices raise. Keys of ``prices`` are matched like GPU names; an unknown key raises.
    """
    prices = prices or {}
    user = {}
    for k, v in prices.items():
        g = get_gpu(k, extra_csv)["name"]
        if v is None or not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != v:
            raise ValueError(f"price for {k!r} must be a non-negative number (per GPU-hour), got {v!r}.")
        user[g] = float(v)
    out = {}
    for n in names:
        g = get_gpu(n, extra_csv)
        out[g["name"]] = user.get(g["name"], g["example_price_per_hour"])
    return out
