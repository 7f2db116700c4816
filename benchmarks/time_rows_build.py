"""Build ``benchmarks/reference/time_rows.json``: the measured step times the time model is fitted and judged on.

Reads the shared reference folder (``published_gpu_runs.json``, ``peft_metamathqa/*.json``, ``cuda_h200.json``)
and writes one row per measured training speed, with its source (URL or file and field), the settings as the
kit names them, the GPU (a catalog name), and the measured seconds per optimizer step and tokens per step. A row
the kit cannot plan keeps an ``out_of_scope`` reason instead of being dropped. ``role`` says whether
``benchmarks/time_published.py`` fits the constants on it ("fit") or only judges them ("judged").

    .venv/bin/python benchmarks/time_rows_build.py [--reference ../shared/reference]

The output is committed, so a fresh clone reproduces every figure without the reference folder.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

OUT = Path(__file__).parent / "reference" / "time_rows.json"
PEFT_URL = "https://github.com/huggingface/peft/blob/main/method_comparison/MetaMathQA/results/"
QWEN_URL = "https://github.com/QwenLM/Qwen/blob/main/README.md#profiling-of-memory-and-speed"
# Qwen-7B (remote code, QWenLMHeadModel) has the shapes of a Llama with these fields: fused c_attn = q,k,v of
# 4096 (MHA), w1/w2 = gate/up of 11008 (config intermediate_size 22016 / 2), c_proj = down, untied lm_head.
QWEN7B_AS_LLAMA = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 151936}
FIT_H200 = {"l8b-lora-ckpt-s2048", "l8b-qlora-ckpt-s2048", "l1b-full-s2048-b4", "l8b-lora-s2048-b2-nockpt",
            "q3-8b-lora-ckpt-s8192"}
FIT_PEFT = {"lora--llama-3.2-3B-rank32", "full-finetuning--llama-3.2-3B-lr_0.00001"}
FIT_QWEN = {"qwen:Qwen-7B-s256"}
PEFT_LORA_LIKE = {"rank64-rslora": "rsLoRA only changes the scale alpha/sqrt(r): the same kernels as LoRA"}


def _settings(**kw) -> dict:
    base = dict(method="lora", dtype="bfloat16", autocast=False, seq_len=2048, batch_size=1, lora_rank=16,
                lora_targets="all-linear", gradient_checkpointing=True, attn_implementation="sdpa",
                optimizer="adamw", num_gpus=1, sharding="none", grad_accum=1)
    base.update(kw)
    return base


def h200_rows(ref: Path) -> list:
    d = json.loads((ref / "cuda_h200.json").read_text())
    rows = []
    for r in d["rows"]:
        if "settings" not in r:
            continue
        s = r["settings"]
        steps = [x["seconds"] for x in r["steps"]][2:]
        rows.append({
            "id": f"h200:{r['case']}", "source": "our H200 run (shared rows)",
            "url": "../shared/reference/cuda_h200.json", "field": f"rows[case={r['case']}].median_step_seconds_after_2",
            "model": r["model"], "gpu": "H200",
            "settings": _settings(method=s["method"], seq_len=s["seq"], batch_size=s["batch"], lora_rank=s["rank"],
                                  lora_targets=s["targets"], gradient_checkpointing=s["ckpt"], optimizer=s["optim"]),
            "measured": {"step_seconds": r["median_step_seconds_after_2"], "tokens_per_step": r["tokens_per_step"],
                         "spread_seconds": [min(steps), max(steps)]},
            "role": "fit" if r["case"] in FIT_H200 else "judged", "out_of_scope": None,
            "notes": ("torch 2.11, transformers 5.24, peft 0.21.2, bitsandbytes 0.50.2; random init, no mask; QLoRA via "
                      "prepare_model_for_kbit_training (fp32 up-casts); median of steps 3-5"
                      + (f"; allocator {s['alloc']}" if s.get("alloc") else ""))})
    return rows


def peft_rows(ref: Path) -> list:
    rows = []
    for f in sorted((ref / "peft_metamathqa").glob("*.json")):
        d = json.loads(f.read_text())
        ri, ti = d["run_info"], d["train_info"]
        pc, tc = ri.get("peft_config") or {}, ri["train_config"]
        blocks = [m for m in ti["metrics"] if "train time" in m]
        steps = max(m["step"] for m in blocks)
        train_s = sum(m["train time"] for m in blocks)
        tokens = next(m["train total tokens"] for m in ti["metrics"] if "train total tokens" in m)
        name = f.stem
        full = name.startswith("full-finetuning")
        kind = pc.get("peft_type")
        reason = None
        if not full and kind != "LORA":
            reason = f"method {kind} (the kit plans full fine-tuning, LoRA and QLoRA only)"
        elif pc.get("use_dora"):
            reason = "DoRA (weight-magnitude decomposition adds a norm of every adapted weight per step; not modelled)"
        elif tc.get("optimizer_type") != "AdamW":
            reason = f"optimizer {tc.get('optimizer_type')} (LoRA-FA freezes A; not modelled)"
        elif not full and any(k in name for k in ("mica", "bdlora")):
            reason = "a LoRA variant with extra per-step work (" + name.split("-")[-1] + "); not modelled"
        per_row = tokens / (steps * tc["batch_size"])
        rows.append({
            "id": f"peft:{name}", "source": "huggingface/peft method_comparison MetaMathQA (L40S)",
            "url": PEFT_URL + f.name,
            "field": "train_info.metrics[*]['train time'] summed / steps; 'train total tokens' / (steps * batch)",
            "model": "llama-3.2-3b", "gpu": "L40S",
            "settings": _settings(method="full" if full else "lora", seq_len=round(per_row), batch_size=tc["batch_size"],
                                  lora_rank=pc.get("r") or 16,
                                  lora_targets=sorted(pc["target_modules"]) if isinstance(pc.get("target_modules"), list)
                                  else "all-linear",
                                  gradient_checkpointing=bool(tc["use_gc"]), autocast=bool(tc["use_amp"])),
            "measured": {"step_seconds": train_s / steps, "tokens_per_step": tokens / steps},
            "role": "fit" if name in FIT_PEFT else "judged", "out_of_scope": reason,
            "notes": (f"{steps} steps of batch {tc['batch_size']}, rows padded to the longest in a length-bucketed "
                      f"batch: seq_len = mean real tokens per row ({per_row:.0f}; padding not published); "
                      "train time excludes evaluation; no AMP, adapters autocast to fp32; torch "
                      + d["meta_info"]["package_info"]["torch-version"]
                      + ("; full fine-tuning keeps AdamW states in bf16 (params bf16)" if full else "")
                      + (f"; {PEFT_LORA_LIKE['rank64-rslora']}" if "rslora" in name else ""))})
    return rows


def published_rows(ref: Path) -> list:
    """The other sources' time figures (in published_gpu_runs.json's notes), one row each."""
    pub = json.loads((ref / "published_gpu_runs.json").read_text())

    def src(r):
        return {"source": r["source"], "url": r["url"]}

    rows = []
    qwen = [r for r in pub if r["source"].startswith("QwenLM")]
    for r in qwen:
        m = r["notes"] or ""
        if "s/it" not in m:
            continue
        secs = float(m.split("s/it")[0].split()[-1])
        gptq = "GPTQ" in r["method"]
        rows.append({
            "id": f"qwen:{r['model'].split('/')[-1]}-s{r['seq_len']}", **src(r),
            "field": "published_gpu_runs.json notes (README table 's/it', 8 micro-steps per iteration)",
            "model": None if gptq else "qwen-7b (as a Llama of its shapes)", "model_config": None if gptq else QWEN7B_AS_LLAMA,
            "gpu": "A100-80GB",
            "settings": _settings(method="qlora" if gptq else "lora", seq_len=int(r["seq_len"]), batch_size=1,
                                  lora_rank=64, lora_targets="all-linear", gradient_checkpointing=True,
                                  dtype="float16" if gptq else "bfloat16", grad_accum=8,
                                  autocast=True),
            "measured": {"step_seconds": secs, "tokens_per_step": 8 * int(r["seq_len"])},
            "role": "fit" if f"qwen:{r['model'].split('/')[-1]}-s{r['seq_len']}" in FIT_QWEN else "judged",
            "out_of_scope": "GPTQ int4 kernels (auto-gptq), not bitsandbytes NF4" if gptq else None,
            "notes": ("HF Trainer --bf16 (autocast; peft of 2023 kept adapters in the base dtype), FlashAttention-2, "
                      "PyTorch 2.0, CUDA 11.8; Qwen's remote modelling code (modeling_qwen.py) calls flash-attn's fused rotary "
                      "and rms_norm kernels when installed: fewer element-wise kernels than HF Llama code the kit "
                      "models; 1 iteration = 8 micro-steps of batch 1 + "
                      "one optimizer step; optimizer assumed AdamW (torch)")})
    a = [r for r in pub if r["source"].startswith("Answer.AI") and " s per " in (r["notes"] or "")]
    for r in a:
        if "CPU param offload" in r["method"]:
            rows.append({"id": "answerai:llama-2-70b-offload", **src(r), "field": "published_gpu_runs.json notes",
                         "model": "llama-2-70b", "gpu": "RTX-3090 / RTX-4090", "settings": None,
                         "measured": {"note": r["notes"]}, "role": "judged",
                         "out_of_scope": "CPU parameter offload over PCIe on power-capped cards (not modelled)",
                         "notes": r["missing_settings"]})
            continue
        samples_s = float(r["notes"].split(" s per")[0])
        rows.append({
            "id": "answerai:llama-2-7b-qlora-fsdp-b10", **src(r),
            "field": "published_gpu_runs.json notes ('466 s per 1,024 samples on 2x4090')", "model": "llama-2-7b",
            "gpu": "RTX-4090",
            "settings": _settings(method="qlora", seq_len=2048, batch_size=10, lora_rank=64,
                                  lora_targets=["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"],
                                  gradient_checkpointing=True, num_gpus=2, sharding="fsdp"),
            "measured": {"step_seconds": samples_s / (1024 / (2 * 10)), "tokens_per_step": 2 * 10 * 2048},
            "role": "judged", "out_of_scope": "recipe not modelled: Answer.AI's train.py loads NF4 with bf16 "
            "quant_storage and no prepare_model_for_kbit_training (bf16 activations, no fp32 up-casts), FSDP over "
            "PCIe with its own wrapping; library versions not stated",
            "notes": r["missing_settings"]})
    for r in pub:
        s = r["source"]
        if s.startswith("LitGPT") and r["notes"] and "min" in r["notes"]:
            rows.append({"id": f"litgpt:{r['model'].split('/')[-1]}-{r['method'].split()[0].lower()}", **{"source": s, "url": r["url"]},
                         "field": "published_gpu_runs.json notes", "model": r["model"], "gpu": "A10G",
                         "settings": None, "measured": {"note": r["notes"]}, "role": "judged",
                         "out_of_scope": "missing settings: minutes per 2 epochs of Alpaca2k with validation and "
                         "generation inside the timed script; tokens per epoch not published; LitGPT's chunked "
                         "lm_head and loss (not HF's)", "notes": r["missing_settings"]})
        elif s.startswith("torchtune") and r["notes"] and ("tok/s" in r["notes"] or "s/it" in r["notes"]):
            why = ("torch.compile, chunked cross-entropy and activation offloading (not modelled); token counting "
                   "differs from the kit's" if "README" in s else
                   "missing settings: what one iteration holds (gradient accumulation) is not stated")
            rows.append({"id": f"torchtune:{r['model'].split('/')[-1]}-{r['method'].split()[0].lower()}",
                         "source": s, "url": r["url"], "field": "published_gpu_runs.json notes", "model": r["model"],
                         "gpu": r["gpu"], "settings": None, "measured": {"note": r["notes"]}, "role": "judged",
                         "out_of_scope": why, "notes": r["missing_settings"]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", default=str(Path(__file__).parents[2] / "shared" / "reference"),
                    help="the shared reference folder (default ../shared/reference)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    ref = Path(a.reference)
    if not (ref / "cuda_h200.json").is_file():
        raise SystemExit(f"{ref} has no cuda_h200.json: pass --reference with the shared reference folder.")
    rows = h200_rows(ref) + peft_rows(ref) + published_rows(ref)
    doc = {"_about": __doc__.split("\n\n")[1].replace("\n", " "), "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    ins = [r for r in rows if not r["out_of_scope"]]
    print(f"{len(rows)} rows ({len(ins)} in scope: {sum(r['role'] == 'fit' for r in ins)} fit, "
          f"{sum(r['role'] == 'judged' for r in ins)} judged) -> {a.out}")
    print("median PEFT LoRA step (s):", statistics.median(r["measured"]["step_seconds"] for r in ins if r["id"].startswith("peft")))


if __name__ == "__main__":
    main()
