"""The smoke run sharded with FSDP2 over 2 real CPU processes (torchrun, gloo), launched as the accelerate config the
kit wrote says, checked against one process training the same examples with the same loss average."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from lora_kit.run.smoke import smoke_run

STEP = {"max_steps": 2, "batch_size": 2, "seq_len": 32, "lora_rank": 4, "lora_alpha": 8, "max_new_tokens": 2,
        "sharding": "fsdp", "num_gpus": 2, "optimizer": "adamw", "dtype": "float32"}
# fp32 on CPU. The two runs average the same two micro-batch gradients, FSDP2 by its reduce-scatter, one process by
# accumulation: here the adapters came out bit-identical; the tolerance leaves room for another summation order
ATOL, RTOL = 1e-6, 1e-5


def _tensors(adapter_dir):
    from safetensors.torch import load_file
    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _logits(model_dir, adapter_dir, batch):
    from lora_kit.loading import load_model
    from lora_kit.run.adapter_io import load_adapter, logits
    model, _ = load_adapter(load_model(str(model_dir), method="lora", dtype="float32"), adapter_dir)
    return logits(model, batch)


def test_fsdp2_two_process_smoke_run_equals_one_process(random_llama_dir, tmp_path):
    data = tmp_path / "train.jsonl"  # lengths differ, so per-rank token counts differ too
    data.write_text("".join(json.dumps({"prompt": f"Q{i}" + "x" * (i % 7), "response": f"A{i}"}) + "\n"
                            for i in range(32)))
    control = tmp_path / "control.jsonl"
    control.write_text(json.dumps({"prompt": "hi", "response": "ho"}) + "\n")
    common = {**STEP, "model": str(random_llama_dir), "dataset": str(data), "control_dataset": str(control)}

    # The reference: one process, grad_accum = 2 (ranks x 1): the same examples, the same loss average. Planned
    # for num_gpus=2 with fsdp, it writes the accelerate config of the multi-GPU run.
    ref = smoke_run(**common, grad_accum=2, run_dir=str(tmp_path / "ref"), measure_steps=2, simulate=False,
                    progress=False, cpu_threads=1)
    assert ref.ok and ref.record["launch"]["sharding"] == "none"
    written = tmp_path / "ref" / "smoke" / "accelerate_config.yaml"
    cfg = yaml.safe_load(written.read_text())

    # Launch as that config says. accelerate's own CPU launcher (accelerate launch --cpu --num_processes 2)
    # starts one process on this stack, so torchrun runs its num_processes; FSDP version 2 is sharding="fsdp".
    fsdp = cfg["fsdp_config"]
    assert cfg["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert fsdp["fsdp_offload_params"] is False and fsdp["fsdp_activation_checkpointing"] is False
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def launch(run_dir):
        params = run_dir.with_suffix(".yaml")
        params.write_text(yaml.safe_dump({**common, "grad_accum": 1, "num_gpus": cfg["num_processes"],
                                          "gradient_checkpointing": fsdp["fsdp_activation_checkpointing"],
                                          "cpu_offload": fsdp["fsdp_offload_params"], "run_dir": str(run_dir)}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(cfg["num_processes"]), "-m", "lora_kit.run.smoke", "--params", str(params), "--measure-steps", "2"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out, json.loads((run_dir / "smoke" / "smoke.json").read_text())

    # A real rank is not always deterministic under CPU load: gloo's worker thread can release a collective's buffer
    # late, so the tracked rank holds it at a later moment (tests/test_sharded.py; here once +148,480 B on a
    # 1,228,800 B peak in CI). Up to 3 launches: the checks below hold for the first within 10 % of simulate.
    for attempt in range(3):
        out, rec = launch(tmp_path / f"run{attempt}")
        sim_peak = (rec.get("memory_model") or {}).get("simulate", {}).get("peak_allocated_bytes")
        if sim_peak and sim_peak <= rec["peaks"]["per_rank"][0]["design_step_peak_bytes"] <= 1.1 * sim_peak:
            break
    smoke = tmp_path / f"run{attempt}" / "smoke"
    assert rec["status"] == "complete" and rec["launch"]["world_size"] == 2
    assert rec["launch"]["sharding"] == "fsdp (FSDP2, 2 ranks)" and "sharding: fsdp (FSDP2, 2 ranks)" in out.stdout
    assert rec["launch"]["fsdp"]["layer_class"] == "LlamaDecoderLayer"
    assert yaml.safe_load((smoke / "accelerate_config.yaml").read_text()) == cfg  # what ran is what was launched

    # per-rank peaks; simulate and estimate describe the step that ran: one GPU of 2 under fsdp
    per_rank = rec["peaks"]["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1] and all(r["design_step_peak_bytes"] > 0 for r in per_rank)
    measured = per_rank[0]["design_step_peak_bytes"]
    assert rec["peaks"]["design_step_peak_bytes"] == measured
    mm = rec["memory_model"]
    for name in ("simulate", "estimate"):
        assert mm[name]["num_gpus"] == 2 and mm[name]["sharding"] == "fsdp", mm[name]
    # simulate's fake FSDP2 world equals the real rank 0 byte for byte (padded batches: both build the 4-D mask)
    # when the CPU is quiet; under load a real rank has held one late-released buffer more (tests/test_sharded.py
    # says when), so: never below simulate, at most 10 % above, and part by part equal when the totals are.
    # estimate's FSDP2 arithmetic was exact here too, held to tests/test_sharded.py's bound against simulate
    sim_peak = mm["simulate"]["peak_allocated_bytes"]
    assert sim_peak <= measured <= 1.1 * sim_peak, (sim_peak, measured)
    assert mm["simulate"]["error_vs_measured"] == (sim_peak - measured) / measured
    if measured == sim_peak:
        assert mm["simulate"]["breakdown"] == rec["peaks"]["breakdown_at_design_step"]
    assert abs(mm["estimate"]["error_vs_measured"]) <= 0.08, (mm["estimate"], measured)
    assert mm["estimate_fsdp_per_gpu"] == mm["estimate"]["peak_allocated_bytes"]

    # the adapter: gathered from both ranks, written once by rank 0, reloaded into a one-process base, verified
    assert sorted(p.name for p in smoke.iterdir() if p.is_dir()) == ["adapter"]
    assert sorted(p.name for p in (smoke / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert rec["checkpoint"]["gathered_from_ranks"] == 2 and rec["verify"]["passed"]
    assert rec["verify"]["reload_max_abs_diff"] <= rec["verify"]["tolerance"]

    # equal to the one-process run of the same steps, tensor by tensor and in the logits
    mine, theirs = _tensors(smoke / "adapter"), _tensors(ref.adapter_dir)
    assert mine.keys() == theirs.keys() and len(mine) == 2 * 7 * 2  # A and B x 7 linears x 2 layers
    trained = max(theirs[k].abs().max().item() for k in theirs if "lora_B" in k)
    assert trained > 1e-3  # peft starts lora_B at zero: equality below is not two untouched inits
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], atol=ATOL, rtol=RTOL, msg=k)
    batch = {"input_ids": torch.randint(3, 100, (2, 16)), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    torch.testing.assert_close(_logits(random_llama_dir, smoke / "adapter", batch),
                               _logits(random_llama_dir, ref.adapter_dir, batch), atol=ATOL, rtol=RTOL)


def test_fsdp_refuses_what_the_sharded_smoke_run_does_not_run(monkeypatch, random_llama_dir, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; refused before any process group is joined
    base = {"model": str(random_llama_dir), "run_dir": str(tmp_path), "sharding": "fsdp", **{
        k: v for k, v in STEP.items() if k not in ("sharding", "optimizer")}}
    with pytest.raises(ValueError, match="method='qlora' is not run"):
        smoke_run(**base, method="qlora")
    with pytest.raises(ValueError, match="optimizer='adamw_8bit'"):
        smoke_run(**base, optimizer="adamw_8bit")
    with pytest.raises(ValueError, match="cpu_offload=True"):
        smoke_run(**base, cpu_offload=True)
