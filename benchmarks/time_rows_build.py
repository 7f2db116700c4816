"""Build ``benchmarks/reference/time_rows.json``: the measured step times the time model is fitted and judged on.

Reads the shared reference folder (``published_gpu_runs.json``, ``peft_metamathqa/*.json``, ``cuda_h200.json``)
and writes one row per measured training speed, with its source (URL or file and field), the settings as the
kit names them, the GPU (a catalog name), and the measured seconds per optimizer step and tokens per step. A row
the kit cannot plan keeps an ``out_of_scope`` reason instead of being dropped. ``role`` says whether
``benchmarks/time_published.py`` fits the constants on it ("fit") or only judges them ("judged"), by one rule
(:data:`SPLIT_RULE`), never by error: within each source and method, in the source's own order, the 1st, 3rd,
5th ... in-scope row is fitted and the 2nd, 4th ... judged.

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
QWEN_TABLE = Path(__file__).parent / "reference" / "qwen_readme_speed.json"  # the README table, every cell
SPLIT_RULE = ("within each source and method, in the source's own order (the H200 file's row order, PEFT's result "
              "files sorted by name, the Qwen README table row by row), the 1st, 3rd, 5th ... in-scope row is "
              "fitted and the 2nd, 4th ... judged; a source added after the constants were first fitted "
              "(fms-acceleration's A100 runs) is judged only, never fitted")
FMS_CSV = Path(__file__).parent / "reference" / "fms_acceleration_a100_80gb.csv"
FMS_COMMIT = "24bdadb228e2d55bc0c69deec034b86a73da6917"
FMS_SOURCE = "foundation-model-stack/fms-acceleration reference benchmarks (A100-80GB, fms-hf-tuning / TRL SFTTrainer)"
FMS_URL = f"https://github.com/foundation-model-stack/fms-acceleration/blob/{FMS_COMMIT}/scripts/benchmarks/refs/a100_80gb.csv"
# Mistral-7B-v0.1's config (the catalog's mistral-7b is v0.3: 32,768 tokens); the time model reads the shapes
MISTRAL_7B_V01 = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768)
FMS_MODELS = {"mistralai/Mistral-7B-v0.1": None, "NousResearch/Llama-2-70b-hf": "llama-2-70b"}
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
            "out_of_scope": None,
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
                                  gradient_checkpointing=bool(tc["use_gc"]), autocast=bool(tc["use_amp"]),
                                  padding="longest"),
            "measured": {"step_seconds": train_s / steps, "tokens_per_step": tokens / steps},
            "out_of_scope": reason,
            "notes": (f"{steps} steps of batch {tc['batch_size']}, rows padded to the longest in a length-bucketed "
                      f"batch: seq_len = mean real tokens per row ({per_row:.0f}; padding not published); "
                      "train time excludes evaluation; padded with an attention mask (SDPA gets a mask); no AMP, adapters autocast to fp32; torch "
                      + d["meta_info"]["package_info"]["torch-version"]
                      + ("; full fine-tuning keeps AdamW states in bf16 (params bf16)" if full else "")
                      + (f"; {PEFT_LORA_LIKE['rank64-rslora']}" if "rslora" in name else ""))})
    return rows


QWEN_OUT = {  # the README's methods the kit cannot plan, with the reason
    "LoRA (emb)": "LoRA (emb) also trains the embedding and lm_head in full (modules_to_save); the kit's LoRA adapts "
                  "block linears only",
    "Q-LoRA": "GPTQ int4 kernels (auto-gptq), not bitsandbytes NF4",
    "Full-parameter": "DeepSpeed ZeRO-2 engine (finetune_ds.sh): its bf16 optimizer keeps fp32 master weights and "
                      "copies gradients into fp32 partitions every micro-step; the kit plans DeepSpeed only over "
                      "several GPUs and does not model its engine's per-micro-step work",
    "LoRA (multinode)": "two nodes (inter-node network not stated): the kit's multi-GPU model is for one machine",
    "LoRA + Deepspeed Zero3": "DeepSpeed ZeRO-3 over 4 GPUs: this benchmark judges the one-GPU step (communication "
                              "is modelled by lora_kit.plan.multi_gpu and not judged here)",
}


def qwen_rows(table: Path = QWEN_TABLE) -> list:
    """Every cell of the Qwen README's speed table (``reference/qwen_readme_speed.json``), one row each."""
    t = json.loads(table.read_text())
    rows = []
    for r in t["rows"]:
        for seq, cell in zip(t["seq_lens"], r["cells"]):
            if "s/it" not in cell:
                continue
            secs = float(cell.split(" / ")[-1].split("s/it")[0])
            cfg = t["models"].get(r["model"])
            why = QWEN_OUT.get(r["method"]) or (None if cfg else f"{r['model']}: no Llama-shaped config here")
            if r["method"] == "Full-parameter" and r["gpus"] > 1:
                why = f"{r['gpus']} GPUs: " + why
            slug = r["method"].split()[0].lower() + ("-emb" if "(emb)" in r["method"] else "") + (
                "-multinode" if "multinode" in r["method"] else "")
            rows.append({
                "id": f"qwen:{r['model']}-{slug}-s{seq}", "source": "QwenLM/Qwen README 'Profiling of Memory and Speed' (2023-11)",
                "url": t["url"], "field": f"table row {r['model']} / {r['method']}, column {seq}: {cell!r}",
                "model": f"{r['model'].lower()} (as a Llama of its shapes)", "model_config": cfg, "gpu": "A100-80GB",
                "settings": _settings(method="lora", seq_len=seq, batch_size=1, lora_rank=64, lora_alpha=16,
                                      lora_targets="all-linear", lora_dropout=0.05, gradient_checkpointing=True,
                                      grad_accum=8, autocast=True, loop="trainer"),
                "measured": {"step_seconds": secs, "tokens_per_step": 8 * seq},
                "timing": {"reentrant_checkpointing": True}, "fused_qkv": True, "out_of_scope": why,
                "notes": ("HF Trainer --bf16 (autocast over bf16 weights: Qwen's remote code casts the model to bf16; "
                          "peft of 2023 created adapters in the base dtype), FlashAttention 2, PyTorch 2.0, CUDA 11.8, "
                          "logging every step; checkpointing reentrant (modeling_qwen.py's QWenModel.forward calls "
                          "torch.utils.checkpoint.checkpoint without use_reentrant: PyTorch 2.0's default); Qwen's modelling code calls flash-attn's fused "
                          "rotary and rms_norm kernels when they are installed (not stated); 1 iteration = 8 "
                          "micro-steps of batch 1 + one optimizer step (adamw_torch)")})
    return rows


def fms_runs(path: Path = FMS_CSV) -> list[dict]:
    """fms-acceleration's reference A100-80GB benchmark (the committed CSV, verbatim at :data:`FMS_COMMIT`), each run
    read once, the one reading both the time rows (:func:`fms_rows`) and the memory rows
    (``benchmarks/cuda_published.py``) use: 100 steps of fms-hf-tuning's ``sft_trainer`` (TRL 0.13 SFTTrainer,
    transformers 4.48.1, peft 0.13.2, bitsandbytes 0.43.3, torch 2.4.1, flash-attn 2.7.3;
    ``scripts/benchmarks/refs/requirements.txt``) on rows packed to 4096 tokens (``benchmark.py``: packing True,
    max_seq_len 4096: every step holds batch x 4096 tokens, which tokens/s x runtime / 100 confirms),
    FlashAttention-2, checkpointing as the Trainer sets it, AdamW (transformers 4.48's Trainer: ``adamw_torch``,
    torch's foreach AdamW, what the kit's own loop runs), no accumulation (``defaults.yaml``); full and LoRA in pure
    bf16 (torch_dtype bfloat16, no bf16 flag), QLoRA with ``bf16: True`` (``scenarios.yaml``), readied by
    ``prepare_model_for_kbit_training``, double quantisation.

    Per run: ``csv_row``, the model as published, ``framework`` (``framework_config``), ``gpus``, ``method``,
    ``step`` (the :class:`lora_kit.settings.Step` fields), ``out_of_scope`` (the reason the kit does not plan the
    run: another stack, several GPUs, a model it does not plan here; None otherwise), ``runtime`` (seconds, None
    when the run did not finish), ``steps``, ``tokens_per_step``, ``allocated`` (torch's peak, bytes),
    and ``nvidia_smi_mib`` as published."""
    import csv
    runs = []
    for i, r in enumerate(csv.DictReader(path.open())):
        model, gpus, fw = r["model_name_or_path"], int(r["num_gpus"]), r["framework_config"]
        method = "qlora" if fw == "baseline-peft-bnb" else ("lora" if r["peft_method"] == "lora" else "full")
        b = int(r["per_device_train_batch_size"])
        step = _settings(method=method, seq_len=4096, batch_size=b, attn_implementation="flash_attention_2",
                         padding="none", autocast=r["bf16"].upper() == "TRUE")
        if method != "full":
            step.update(lora_rank=int(r["r"]), lora_alpha=int(float(r["lora_alpha"])),
                        lora_targets=r["target_modules"].split(), lora_dropout=float(r["lora_dropout"] or 0))
        if method == "qlora":  # TRL 0.13 SFTTrainer: prepare_model_for_kbit_training on a 4-bit model
            step.update(qlora_prepare="peft", double_quant=True)
        why = None
        if fw not in ("", "none", "baseline-peft-bnb"):
            why = f"framework_config {fw}: fms-acceleration's fused kernels or GPTQ (not the plain HF stack)"
        elif gpus != 1:
            why = f"{gpus} GPUs: this benchmark judges the one-GPU step (multi-GPU time is lora_kit.plan.multi_gpu's)"
        elif model not in FMS_MODELS:
            why = f"{model} is not a model the kit plans here" + (
                " (transformers 4.48's Mixtral loops over per-expert nn.Linear layers, which bitsandbytes quantizes "
                "under QLoRA; the kit times transformers 5's fused grouped_mm experts)"
                if "Mixtral" in model else "")
        runtime = float(r["train_runtime"]) if r["train_runtime"] else None
        steps = round(runtime * float(r["train_steps_per_second"])) if runtime else None
        runs.append({"csv_row": i + 1, "model": model, "framework": fw or "none", "gpus": gpus, "method": method,
                     "step": step, "out_of_scope": why, "runtime": runtime, "steps": steps,
                     "tokens_per_step": float(r["train_tokens_per_second"]) * runtime / steps if steps else None,
                     "allocated": r["mem_peak_torch_mem_alloc_in_bytes"] or None,
                     "nvidia_smi_mib": r["mem_nvidia_mem_reserved"] or None})
    return runs


def fms_rows(path: Path = FMS_CSV) -> list:
    """The time rows of :func:`fms_runs`: seconds per step = train_runtime / 100 steps. Judged only."""
    rows = []
    for run in fms_runs(path):
        model, method, b = run["model"], run["method"], run["step"]["batch_size"]
        slug = f"{model.split('/')[-1]}-{run['framework']}-{method}-g{run['gpus']}-b{b}"
        why = run["out_of_scope"]
        if not why and run["runtime"] is None:
            why = "ran out of memory (no time published): a verdict for the memory benchmarks, not a time"
        row = {"id": f"fms:{slug}", "source": FMS_SOURCE, "url": FMS_URL,
               "field": f"row {run['csv_row']}: train_runtime / (train_runtime x train_steps_per_second)",
               "model": FMS_MODELS.get(model) or model, "gpu": "A100-80GB", "settings": run["step"],
               "measured": ({"step_seconds": run["runtime"] / run["steps"], "tokens_per_step": run["tokens_per_step"]}
                            if not why else {"note": f"train_runtime {run['runtime'] or 'none'}"}),
               "out_of_scope": why, "judged_only": True,
               "notes": "TRL 0.13 SFTTrainer, rows packed to 4096 tokens (no position reset: planned as padding "
               "'none')" + ("; QLoRA: bf16=True (autocast); TRL also casts the adapters, "
                                                   "lm_head and embeddings to bf16 (peft_module_casting_to_bf16)"
                                                   if method == "qlora" else "")}
        if FMS_MODELS.get(model, "") is None:
            row["model_config"] = MISTRAL_7B_V01
        rows.append(row)
    return rows


def assign_roles(rows: list) -> list:
    """``role`` by :data:`SPLIT_RULE`: alternate in-scope rows within each (source, method), in the given order;
    rows marked ``judged_only`` are judged."""
    seen: dict = {}
    for r in rows:
        if r["out_of_scope"]:
            r["role"] = None  # not evaluated; listed with its reason
            continue
        if r.get("judged_only"):
            r["role"] = "judged"
            continue
        key = (r["source"], r["settings"]["method"])
        r["role"] = "fit" if seen.get(key, 0) % 2 == 0 else "judged"
        seen[key] = seen.get(key, 0) + 1
    return rows


def published_rows(ref: Path) -> list:
    """The other sources' time figures (in published_gpu_runs.json's notes), one row each; the Qwen README's are
    read from its full table (:func:`qwen_rows`), not from the two cells published_gpu_runs.json repeats."""
    pub = json.loads((ref / "published_gpu_runs.json").read_text())

    def src(r):
        return {"source": r["source"], "url": r["url"]}

    rows = []
    a = [r for r in pub if r["source"].startswith("Answer.AI") and " s per " in (r["notes"] or "")]
    for r in a:
        if "CPU param offload" in r["method"]:
            rows.append({"id": "answerai:llama-2-70b-offload", **src(r), "field": "published_gpu_runs.json notes",
                         "model": "llama-2-70b", "gpu": "RTX-3090 / RTX-4090", "settings": None,
                         "measured": {"note": r["notes"]},
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
            # Answer.AI's recipe (NF4 stored as bf16, no prepare_model_for_kbit_training) is planned since the Step's
            # qlora_prepare "none" (what "auto" gives sharding "fsdp"); the run's software is what keeps it out
            "out_of_scope": "library versions not stated, and the run (Feb-Mar 2024) predates the bitsandbytes 4-bit "
            "kernels whose dequantisation cost the time model fits (benchmarks/time_published.py prints the kit's "
            "prediction for it); Answer.AI's own FSDP-1 loop over PCIe", "show": True,
            "notes": r["missing_settings"] + "; Answer.AI's own FSDP-1 loop over PCIe, planned as FSDP2 with "
            "qlora_prepare 'none' (auto)"})
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
                   "torchtune's own Llama code with torchao NF4 (not HF modelling code with bitsandbytes); what one "
                   "iteration holds (gradient accumulation) and the padded tokens per batch are not stated")
            rows.append({"id": f"torchtune:{r['model'].split('/')[-1]}-{r['method'].split()[0].lower()}",
                         "source": s, "url": r["url"], "field": "published_gpu_runs.json notes", "model": r["model"],
                         "gpu": r["gpu"], "settings": None, "measured": {"note": r["notes"]},
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
    rows = assign_roles(h200_rows(ref) + peft_rows(ref) + qwen_rows() + published_rows(ref) + fms_rows())
    doc = {"_about": __doc__.split("\n\n")[1].replace("\n", " "), "split_rule": SPLIT_RULE, "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    ins = [r for r in rows if not r["out_of_scope"]]
    print(f"{len(rows)} rows ({len(ins)} in scope: {sum(r['role'] == 'fit' for r in ins)} fit, "
          f"{sum(r['role'] == 'judged' for r in ins)} judged) -> {a.out}")
    print("median PEFT LoRA step (s):", statistics.median(r["measured"]["step_seconds"] for r in ins if r["id"].startswith("peft")))


if __name__ == "__main__":
    main()
