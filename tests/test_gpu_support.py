"""What a card cannot run of a step (bf16, FlashAttention-2 before Ampere): one rule (lora_kit.plan.gpus.gpu_problems),
said beside the verdict by `lora-kit estimate` and check_plan, marked in the method x GPU table and its
recommendation, refused by `lora-kit run` before notebook 00, and named by the axolotl `bf16: auto` note."""
import json
import math

import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.plan.config_import import bf16_auto_note, settings_from_config
from lora_kit.plan.gpus import add_gpu, gpu_problems, has_bf16, known_gpus, remove_user_gpus
from lora_kit.plan.planner import check_plan, compare_methods, verdict_text
from lora_kit.ui.cli import main
from lora_kit.ui.tables import method_rows

MODEL = "llama-3.2-1b"
NO_BF16 = "T4 has no bf16 (compute capability 7.5; bf16 needs 8.0, Ampere, or newer"
FA2 = "flash_attention_2 needs compute capability 8.0 (Ampere) or newer; the T4 is 7.5: use attn_implementation='sdpa'"


def _flat(text: str) -> str:
    return " ".join(text.split())  # the CLI wraps its lines at 110 characters


def test_the_rule_t4_against_ampere_and_newer():
    (bf16,) = gpu_problems("T4")  # the planning default: bf16
    assert bf16.startswith(NO_BF16) and bf16.endswith("plan dtype='float16' (the memory estimate stays: bf16 and fp16 "
                                                      "are both 2 bytes)"), bf16
    assert gpu_problems("T4", dtype="float16") == []
    for gpu in ("L4", "A10G", "A100-80GB", "H100-SXM"):
        assert gpu_problems(gpu) == [] and gpu_problems(gpu, attn_implementation="flash_attention_2") == []
    assert gpu_problems("T4", dtype="float16", attn_implementation="flash_attention_2") == [FA2]
    packed = gpu_problems("T4", dtype="float16", attn_implementation="flash_attention_2", padding="packed")
    assert packed == [FA2 + " and padding='max_length' (padding-free packed rows need flash_attention_2)"]
    (auto,) = gpu_problems("T4", dtype="float32", autocast=True)  # fp32 weights under autocast compute in bf16
    assert "autocast over float32 weights, in bf16: plan dtype='float16' (16-bit weights: estimate again)" in auto
    (adapters,) = gpu_problems("T4", method="qlora", dtype="float16", qlora_prepare="none")
    assert adapters.endswith("qlora_prepare='none' (bf16 LoRA adapters): qlora_prepare='peft' (fp32 adapters)")
    # the claim the bf16 sentence makes: the memory estimate is the same in fp16
    for method in ("lora", "qlora"):
        a, b = estimate(MODEL, method=method), estimate(MODEL, method=method, dtype="float16")
        assert (a.device_total_bytes, a.peak_allocated_bytes) == (b.device_total_bytes, b.peak_allocated_bytes)


def test_a_pre_ampere_card_of_the_users_own_and_one_without_compute_capability():
    try:
        add_gpu("V100-mine", memory_gb=32, memory_bandwidth_gbs=900, bf16_tflops=None, fp16_tflops=125,
                compute_capability=7.0)
        add_gpu("Unknown-cc", memory_gb=24, memory_bandwidth_gbs=600, bf16_tflops=100)
        assert not has_bf16("V100-mine") and has_bf16("Unknown-cc") and has_bf16("L4") and not has_bf16("T4")
        (p,) = gpu_problems("V100-mine")
        assert p.startswith("V100-mine has no bf16 (compute capability 7.0;"), p
        assert gpu_problems("Unknown-cc", attn_implementation="flash_attention_2") == []  # unknown: not judged
        assert "V100-mine" in bf16_auto_note()  # the axolotl note follows the same rule
    finally:
        remove_user_gpus()


def test_axolotl_bf16_auto_note_names_exactly_the_gpus_the_rule_refuses_bf16(tmp_path):
    without = [g for g in known_gpus() if gpu_problems(g, dtype="bfloat16")]
    assert without == [g for g in known_gpus() if not has_bf16(g)] == ["T4"]
    ax = tmp_path / "ax.yml"
    ax.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nsequence_len: 2048\nbf16: auto\n")
    _, rep = settings_from_config(ax)
    note = next(n for n in rep.notes if n.startswith("bf16: auto"))
    assert note == bf16_auto_note() and "(the catalog's T4)" in note and "compute capability 8.0" in note


def test_estimate_cli_says_what_the_t4_cannot_run_beside_its_verdict(capsys):
    assert main(["estimate", "--model", MODEL, "--gpu", "T4"]) == 0
    out = _flat(capsys.readouterr().out)
    verdict = "T4: fits with a 10% margin"
    assert verdict in out and f"T4 CANNOT RUN this step as planned: {NO_BF16}" in out
    assert out.index(verdict) < out.index("CANNOT RUN")
    for args in (["--gpu", "L4"], ["--gpu", "A100-80GB"], ["--gpu", "T4", "--dtype", "float16"]):
        assert main(["estimate", "--model", MODEL, *args]) == 0
        assert "CANNOT RUN" not in capsys.readouterr().out, args
    assert main(["estimate", "--model", MODEL, "--gpu", "T4", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["runs_on_gpu"] is False and js["gpu_problems"][0].startswith(NO_BF16) and js["fit"]["fits"] is True


def test_estimate_from_an_axolotl_config_on_the_t4_names_bf16_and_flash_attention(capsys):
    cfg = "tests/configs/axolotl_qlora_llama-3.1-8b.yml"  # bf16: auto, flash_attention: true, sample_packing: true
    assert main(["estimate", "--from-config", cfg, "--gpu", "T4"]) == 0
    out = _flat(capsys.readouterr().out)
    assert out.count("T4 CANNOT RUN this step as planned") == 2 and NO_BF16 in out
    assert FA2 + " and padding='max_length'" in out and "(the catalog's T4) it trains in fp16" in out
    assert main(["estimate", "--from-config", cfg, "--gpu", "A100-80GB"]) == 0
    assert "CANNOT RUN" not in capsys.readouterr().out


def test_check_plan_and_its_verdict_text():
    t4 = check_plan(MODEL, "T4")
    assert t4["fits"] and not t4["runs_on_gpu"] and t4["gpu_problems"][0].startswith(NO_BF16)
    assert f"T4 cannot run this step as planned: {NO_BF16}" in verdict_text(t4)
    l4 = check_plan(MODEL, "L4")
    assert l4["runs_on_gpu"] and l4["gpu_problems"] == [] and "cannot run" not in verdict_text(l4)


def test_method_table_keeps_the_t4_row_visible_but_never_recommends_it():
    gpus = ["T4", "L4", "A100-80GB"]
    df = compare_methods(MODEL, gpus=gpus, methods=("lora",), prices={"T4": 0.01, "L4": 0.8, "A100-80GB": 1.8})
    t4 = df[df["gpu"] == "T4"].iloc[0]
    assert t4["fits"] and not t4["runs_on_gpu"] and t4["gpu_problem"].startswith(NO_BF16)  # fits: memory only
    assert math.isnan(t4["epoch_cost"]) and math.isnan(t4["step_seconds"]) and t4["device_total_gib"] > 0
    assert df[df["gpu"] != "T4"]["runs_on_gpu"].all() and (df[df["gpu"] != "T4"]["gpu_problem"] == "").all()
    rec = df.attrs["recommendation"]
    assert "Cheapest per epoch: LoRA on T4" not in rec and "Fastest: LoRA on T4" not in rec
    assert ("Not recommended (memory shown, no time or cost): LoRA on T4, which cannot run this step as planned: "
            + NO_BF16) in rec and "LoRA fits on L4, A100-80GB." in rec
    rows = method_rows(df, currency="USD")
    row = rows[rows["GPU"] == "T4"].iloc[0]
    assert (row["fits"], row["runs on GPU"], row["step (s)"], row["cost per epoch (USD)"]) == ("✓", "✗", "—", "—")
    assert rows.iloc[rows.attrs["recommended"]]["GPU"] != "T4"
    assert list(rows[rows["GPU"] != "T4"]["runs on GPU"]) == ["✓", "✓"]
    assert "✗ in 'runs on GPU' = the GPU cannot run this step as planned" in rows.attrs["caption"]
    assert NO_BF16 in rows.attrs["caption"]
    # planned in fp16 the T4 runs it: no column, a time and a cost, and at a cent an hour it is the cheapest
    fp16 = compare_methods(MODEL, gpus=gpus, methods=("lora",), dtype="float16",
                           prices={"T4": 0.01, "L4": 0.8, "A100-80GB": 1.8})
    assert fp16["runs_on_gpu"].all() and fp16["epoch_cost"].notna().all()
    assert "runs on GPU" not in method_rows(fp16, currency="USD").columns
    assert fp16.attrs["recommendation"].startswith("Cheapest per epoch: LoRA on T4")


def test_nothing_that_fits_runs():
    df = compare_methods(MODEL, gpus=["T4"], methods=("lora",))
    assert df.attrs["recommendation"].startswith("Nothing that fits can run on its GPU as planned. Not recommended")


@pytest.mark.parametrize("args, said", [
    (["-p", "dtype", "bfloat16"], NO_BF16),
    (["-p", "dtype", "float16", "-p", "attn_implementation", "flash_attention_2"], FA2)])
def test_run_refuses_a_step_the_named_gpu_cannot_run(tmp_path, capsys, args, said):
    runs = tmp_path / "runs"
    assert main(["run", "-p", "gpu", "T4", *args, "--runs-dir", str(runs), "--name", "x"]) == 2
    err = _flat(capsys.readouterr().err)
    assert err.startswith("lora-kit run: invalid settings: gpu='T4', the GPU this run plans for, cannot run its step: ")
    assert said in err and "change it with -p KEY VALUE or in the params file. Nothing ran" in err
    assert not runs.exists()


def test_run_lets_the_same_step_through_on_an_ampere_gpu(tmp_path, capsys):
    # an unknown --only is refused after the GPU check: the message is that one, not the GPU's
    assert main(["run", "-p", "gpu", "L4", "-p", "dtype", "bfloat16", "--only", "zz", "--runs-dir",
                 str(tmp_path / "runs"), "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and "cannot run its step" not in err


def test_catalog_name_of_the_names_cuda_reports():
    """torch.cuda.get_device_name() / nvidia-smi names to catalog rows (the GPU session and gpu_validate use it)."""
    from lora_kit.plan.gpus import catalog_name, known_gpus
    cases = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA H100 PCIe": "H100-PCIe",
             "NVIDIA A100-SXM4-40GB": "A100-40GB", "NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA L40S": "L40S",
             "NVIDIA L4": "L4", "NVIDIA A10G": "A10G", "NVIDIA GeForce RTX 4090": "RTX-4090", "Tesla T4": "T4",
             "NVIDIA RTX 6000 Ada Generation": "RTX-6000-Ada", "Quadro P400": None}
    assert {k: catalog_name(k) for k in cases} == cases
    assert {v for v in cases.values() if v} <= set(known_gpus())
