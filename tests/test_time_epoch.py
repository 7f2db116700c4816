"""Time and cost per epoch on the run card: the user's own data, an interval from the model's measured error,
narrowed when the smoke run measured the planned model on the planned GPU."""
import json

import pytest

from lora_kit.plan import time_constants as C
from lora_kit.plan.planner import compare_methods, epoch_from_data, steps_per_epoch
from lora_kit.plan.records import plan_record
from lora_kit.plan.timing import step_time
from lora_kit.plan.gpus import get_gpu
from lora_kit.settings import Settings, as_step
from lora_kit.ui import run_card
from lora_kit.ui.run_card import build_report

STEP = dict(seq_len=1024, lora_rank=16, gradient_checkpointing=True)
DATA = {"rows": 1300, "usable": 1200, "mean_length": 400.0, "seq_len": 1024}


@pytest.fixture(scope="module")
def table():
    return compare_methods("llama-3.2-1b", gpus=["L4", "H100-SXM"], methods=["lora", "qlora"], batch_size=4, **STEP)


def _run(tmp_path, table, smoke, method="lora", gpu="H100-SXM"):
    s = Settings(method=method, gpu=gpu, run_dir=str(tmp_path), **STEP)
    (tmp_path / "settings.json").write_text(json.dumps(s.to_dict()))
    (tmp_path / "plan.json").write_text(json.dumps(plan_record(table, "llama-3.2-1b", margin=0.1, **STEP)))
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "smoke.json").write_text(json.dumps(smoke))
    build_report(tmp_path)
    return json.loads((tmp_path / "report.json").read_text()), (tmp_path / "report.md").read_text()


def test_epoch_is_the_users_data_with_the_uncalibrated_interval(tmp_path, table):
    rep, md = _run(tmp_path, table, {"status": "complete", "data": DATA})
    et = rep["epoch_time"]
    assert et["epoch"]["examples"] == 1200 and et["epoch"]["tokens"] == 480_000
    row = table[(table["method"] == "lora") & (table["gpu"] == "H100-SXM")].iloc[0]
    assert et["steps"] == -(-1200 // 4) == steps_per_epoch(et["epoch"], 4, 1024, 1, 1)
    assert et["hours"] == pytest.approx(et["steps"] * row["step_seconds"] / 3600)
    assert et["error_factor"] == C.ERROR_FACTOR_UNCALIBRATED and et["calibration"] is None
    assert et["hours_low"] < et["hours"] < et["hours_high"] and et["cost_low"] < et["cost"] < et["cost_high"]
    assert "1,200 rows" in md and "before calibration" in md and "Time and cost per epoch" in md
    # the request's table was planned before the smoke run read the data, with the placeholder epoch: its times,
    # costs and recommendation are recomputed for the user's data (the planned row's cost is the one above)
    request = md.split("## The request")[1].split("\n## ")[0]
    assert "1,200 examples = 480,000 tokens" in request and "placeholder of 10,000 examples" in request
    from lora_kit.ui.tables import _amount
    h100 = next(line for line in request.splitlines() if line.startswith("| LoRA | H100-SXM |"))
    assert f"| {_amount(et['cost'])} ({_amount(et['cost_low'])}–{_amount(et['cost_high'])}) |" in h100
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows, rec = run_card.request_rows(plan, et)
    assert rec in request and rec != plan["recommendation"]
    fit = rows[rows["fits"]]
    assert fit["epoch_cost"].min() < table[table["fits"]]["epoch_cost"].min() / 5  # 1,200 rows, not 10,000


def test_smoke_run_on_the_planned_gpu_calibrates_and_narrows(tmp_path, table):
    s = Settings(method="lora", gpu="H100-SXM", model="llama-3.2-1b", batch_size=2, dtype="bfloat16", **STEP).to_dict()
    pred = step_time("llama-3.2-1b", get_gpu("H100-SXM"), as_step(s))["step_seconds"]
    smoke = {"status": "complete", "data": DATA, "settings": s, "launch": {"device": "cuda:0"},
             "steps": [{"seconds": 9.0}] + [{"seconds": 1.5 * pred}] * 3}
    rep, md = _run(tmp_path, table, smoke)
    et = rep["epoch_time"]
    assert et["calibration"]["scale"] == pytest.approx(1.5)
    assert et["error_factor"] == min(C.ERROR_FACTOR_CALIBRATED, C.ERROR_FACTOR_UNCALIBRATED)
    assert "after calibrating" in md
    (tmp_path / "cpu").mkdir()
    rep2, _ = _run(tmp_path / "cpu", table, dict(smoke, launch={"device": "cpu"}))  # a CPU run calibrates no GPU
    assert rep2["epoch_time"]["calibration"] is None


def test_epoch_input_is_checked_and_the_placeholder_is_named(table):
    assert "source" not in table.attrs["epoch"]  # the placeholder: 10,000 examples
    with pytest.raises(ValueError, match="smoke run's data statistics"):
        epoch_from_data({"rows": 3})
    with pytest.raises(ValueError, match="epoch"):
        compare_methods("llama-3.2-1b", gpus=["L4"], methods=["lora"], batch_size=1, epoch={"rows": 5})
    packed = compare_methods("llama-3.2-1b", gpus=["L4"], methods=["lora"], batch_size=2,
                             epoch={"tokens": 1_000_000, "packed": True}, **STEP)
    assert packed["steps_per_epoch"].iloc[0] == -(-1_000_000 // (2 * 1024))
    assert packed.attrs["epoch"]["source"] == "yours"


@pytest.mark.parametrize("padding,width,ran", [("longest", 640, 640), ("packed", 1501, 751)])
def test_the_calibration_times_the_tokens_the_smoke_step_ran(tmp_path, table, padding, width, ran):
    """A smoke step padded to its longest row, or packed into one row, ran fewer tokens than batch x seq_len: the
    calibration prices the step that ran (its recorded width; a packed row as batch rows of ceil(width / batch))."""
    kw = dict(attn_implementation="flash_attention_2") if padding == "packed" else {}
    s = Settings(method="lora", gpu="H100-SXM", model="llama-3.2-1b", batch_size=2, dtype="bfloat16",
                 padding=padding, **kw, **STEP).to_dict()
    pred = step_time("llama-3.2-1b", get_gpu("H100-SXM"), as_step({**s, "seq_len": ran}))["step_seconds"]
    full = step_time("llama-3.2-1b", get_gpu("H100-SXM"), as_step(s))["step_seconds"]
    assert pred < full
    smoke = {"status": "complete", "data": DATA, "settings": s, "launch": {"device": "cuda:0"},
             "steps": [{"seconds": 9.0, "seq_len": width}] + [{"seconds": 2.0 * pred, "seq_len": width}] * 3}
    rep, _ = _run(tmp_path, table, smoke)
    assert rep["epoch_time"]["calibration"]["scale"] == pytest.approx(2.0)
