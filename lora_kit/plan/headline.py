"""The QLoRA headline -- "a 65B model fine-tuned on a single 48 GB GPU" -- set up in the kit and explained,
with Llama-3.1-70B beside it (torch-free: the planner's ``estimate`` and fit rule only).

The setting, from the paper and the code it published (read, not copied):

- QLoRA paper (Dettmers et al. 2023, arXiv 2305.14314), abstract: "finetune a 65B parameter model on a single
  48GB GPU"; its Fig. 6 breaks the footprint of LLaMA 7B ... 65B down at batch 1, sequence length 512, with
  gradient checkpointing -- LLaMA-65B about 45.0 GB in total, 37,074 MB of it the 4-bit base model (as
  transcribed from the bar chart into ``/work/shared/reference/published_memory.md``, row 1; the chart does not
  say whether paged optimizer states are in the total).
- ``artidoro/qlora`` ``qlora.py`` (commit 00e5ad2a): ``lora_r=64``, ``lora_alpha=16``, ``double_quant=True``,
  ``quant_type="nf4"``, ``optim="paged_adamw_32bit"``, ``per_device_train_batch_size=1``,
  ``gradient_accumulation_steps=16``, ``gradient_checkpointing=True``; LoRA on every linear layer but
  ``lm_head``; with ``--bf16`` it runs under bf16 autocast and, after ``prepare_model_for_kbit_training``,
  casts the LoRA layers to bf16, the norms to fp32 and ``embed_tokens`` / ``lm_head`` *back to bf16*.
  ``scripts/finetune_guanaco_65b.sh`` (commit 86ac6016) trains with batch 4 x accumulation 4 and
  ``target_max_len`` 512.

So :data:`PAPER_STEP` is the kit's step for that setting (gradient accumulation does not change the peak).
The kit's step keeps ``prepare_model_for_kbit_training``'s fp32 up-casts and peft's fp32 adapters (what users
get from the usual recipe); :func:`qlora_py_bytes` is the arithmetic for what ``qlora.py`` casts back to bf16
(not a step setting: an upper bound on the peak, since every phase holds those weights). bf16 autocast is left
off: the kit's autocast model is its least exact setting (the README's accuracy table says by how much).
"""
from __future__ import annotations

from lora_kit.memory.device import alloc_bytes as _r
from lora_kit.memory.device import device_kwargs, device_total
from lora_kit.memory.estimate import estimate
from lora_kit.memory.specs import model_spec
from lora_kit.plan.planner import GIB, fit_verdict
from lora_kit.settings import Step

PAPER_STEP = Step(method="qlora", dtype="bfloat16", double_quant=True, lora_rank=64, lora_alpha=16,
                  lora_targets="all-linear", gradient_checkpointing=True, optimizer="paged_adamw_32bit",
                  seq_len=512, batch_size=1, grad_accum=16)
GPU_48GB = "L40S"  # a 48 GB card in the catalog (46,068 MiB as CUDA reports it)
FIG6_65B = {"total_bytes": 45.0e9, "base_4bit_bytes": 37_074e6}  # paper Fig. 6, transcribed (see above)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FIGURE = "qlora_65b_on_48gb"  # notebook 01's figure of LLaMA-65B at the paper's setting (the tutorial run only)
FIGURE_NOTE = ("The kit's own check against the QLoRA paper (LLaMA-65B at the paper's setting on a 48 GB GPU, "
               "notebook 01 of the embedded tutorial), not a figure of this run.")


def qlora_py_bytes(model) -> int:
    """Bytes ``qlora.py`` saves against the kit's step by casting ``embed_tokens`` and ``lm_head`` back from
    ``prepare_model_for_kbit_training``'s fp32 to bf16 (2 bytes less per value). Every phase of the step holds
    these weights, so the peak drops by at least this much (its LoRA layers in bf16 save more; not counted)."""
    spec = model_spec(model)
    n = 1 if spec.tied_embeddings else 2
    return n * int(_r(spec.vocab_size * spec.hidden_size * 4) - _r(spec.vocab_size * spec.hidden_size * 2))


def _row(case: str, model, gpu, margin, minus: int = 0, **change) -> dict:
    e = estimate(model, PAPER_STEP, **change)
    peak = e.peak_allocated_bytes - minus
    s = PAPER_STEP.replace(**change)
    total = device_total(peak, **device_kwargs(model_spec(model), s)) \
        if minus else e.device_total_bytes
    return {"case": case, "model": model, "change": ", ".join(f"{k}={v}" for k, v in change.items()) or "-",
            "peak_allocated_bytes": peak, "device_total_bytes": total, "phase": e.phase,
            "breakdown": dict(e.breakdown), "fits_no_margin": bool(fit_verdict(total, gpu, 0.0)["fits"]),
            f"fits_{margin:.0%}_margin": bool(fit_verdict(total, gpu, margin)["fits"]),
            "arithmetic": bool(minus)}


def differences(a: str = "llama-65b", b: str = "llama-3.1-70b") -> list[dict]:
    """The parts of the step that differ between two models at :data:`PAPER_STEP`, bytes each: 4-bit linear
    weights, quantization constants, embedding + lm_head (fp32 after ``prepare_model_for_kbit_training``),
    LoRA adapters, the gradients live at the peak (with checkpointing it is the bottom block's recompute: the
    blocks above have theirs), the optimizer states bitsandbytes does not page (those of tensors under 100,000
    elements), the activations at the peak, and the fp32 logits at the loss (one ``seq x vocab``
    copy; the loss holds up to four). All but the logits add up to the peaks' difference."""
    out = []
    for name in (a, b):
        spec = model_spec(name)
        e = estimate(name, PAPER_STEP)
        emb = (1 if spec.tied_embeddings else 2) * int(_r(spec.vocab_size * spec.hidden_size * 4))
        T = PAPER_STEP.seq_len * PAPER_STEP.batch_size
        out.append({"model": name, "vocab_size": spec.vocab_size,
                    "4-bit linear weights": e.breakdown["weights"] - emb - _norm_bytes(spec),
                    "embedding + lm_head (fp32)": emb, "quantization constants": e.breakdown["quant_constants"],
                    "LoRA adapters (fp32)": e.breakdown["adapters"], "gradients at the peak": e.breakdown["gradients"],
                    "optimizer states not paged": e.breakdown["optimizer_states"],
                    "activations at the peak": e.breakdown["activations"],
                    "logits, one fp32 copy": int(_r(T * spec.vocab_size * 4))})
    return out


def _norm_bytes(spec) -> int:
    return sum(count * int(_r(numel * 4)) for g, numel, count in spec.param_tensors() if g in ("norm", "bias"))


def headline(gpu: str = GPU_48GB, margin: float = 0.10) -> dict:
    """The paper's setting on ``gpu`` for LLaMA-65B and Llama-3.1-70B, what changes the verdict, and the paper's
    own figure beside ours. Returns ``rows`` (one dict per case: peak / device total, fits with no margin and
    with ``margin``, breakdown, whether the row is arithmetic on an estimate), ``differences``
    (:func:`differences`) and ``paper`` (Fig. 6's LLaMA-65B figures against ours, % apart)."""
    bf16_65, bf16_70 = qlora_py_bytes("llama-65b"), qlora_py_bytes("llama-3.1-70b")
    rows = [
        _row("LLaMA-65B, the paper's setting (kit: fp32 up-casts, fp32 adapters)", "llama-65b", gpu, margin),
        _row("LLaMA-65B without the paged optimizer", "llama-65b", gpu, margin, optimizer="adamw"),
        _row("LLaMA-65B as qlora.py casts it (embeddings, lm_head in bf16)", "llama-65b", gpu, margin, bf16_65),
        _row("Llama-3.1-70B, the paper's setting", "llama-3.1-70b", gpu, margin),
        _row("Llama-3.1-70B, lower rank", "llama-3.1-70b", gpu, margin, lora_rank=16),
        _row("Llama-3.1-70B as qlora.py casts it", "llama-3.1-70b", gpu, margin, bf16_70),
        _row("Llama-3.1-70B as qlora.py casts it, lower rank", "llama-3.1-70b", gpu, margin, bf16_70, lora_rank=16),
        _row("Llama-3.1-70B as qlora.py casts it, attention only", "llama-3.1-70b", gpu, margin, bf16_70,
             lora_targets=ATTENTION),
    ]
    e = estimate("llama-65b", PAPER_STEP)
    paged = estimate("llama-65b", PAPER_STEP, optimizer="adamw").breakdown["optimizer_states"]
    ours = {"peak_allocated_bytes": e.peak_allocated_bytes, "device_total_bytes": e.device_total_bytes,
            "peak + paged optimizer states": e.peak_allocated_bytes + paged,
            "base_4bit_bytes": e.breakdown["weights"] + e.breakdown["quant_constants"]}
    paper = {k: {"ours": v, "paper": FIG6_65B["base_4bit_bytes" if k == "base_4bit_bytes" else "total_bytes"],
                 "pct": 100 * (v / FIG6_65B["base_4bit_bytes" if k == "base_4bit_bytes" else "total_bytes"] - 1)}
             for k, v in ours.items()}
    return {"gpu": gpu, "margin": margin, "step": PAPER_STEP.to_dict(), "rows": rows, "differences": differences(),
            "paper": paper, "paged_optimizer_bytes": paged}


def headline_table(h: dict):
    """The rows of :func:`headline` as a DataFrame in GiB (what notebook 01 shows)."""
    import pandas as pd
    m = f"fits_{h['margin']:.0%}_margin"
    return pd.DataFrame([{"case": r["case"], "peak allocated GiB": round(r["peak_allocated_bytes"] / GIB, 2),
                          "device total GiB": round(r["device_total_bytes"] / GIB, 2),
                          f"fits {h['gpu']} (no margin)": r["fits_no_margin"],
                          f"fits with {h['margin']:.0%} margin": r[m],
                          "how": "estimate - bf16 cast (arithmetic)" if r["arithmetic"] else "estimate"}
                         for r in h["rows"]])


def differences_table(h: dict):
    """:func:`differences` of :func:`headline` as a DataFrame: one column per model, the parts in GiB."""
    import pandas as pd
    df = pd.DataFrame(h["differences"]).set_index("model").drop(columns="vocab_size").T
    return (df / GIB).round(3)
