"""The kit's GPU path runs with ``expandable_segments:True`` unless the user set the allocator variable: through the
variable the installed torch reads, before CUDA starts, in the smoke run, its launched ranks and the launch files."""
import json
import os
import subprocess
import sys

import yaml

from lora_kit.run.accelerate_config import write_accelerate_config
from lora_kit.run.alloc_conf import DEFAULT, NEW, OLD, apply_default, in_effect, names_read, variable
from lora_kit.run.smoke import smoke_run

FAST = dict(max_steps=1, batch_size=1, seq_len=32, lora_rank=4, lora_alpha=8, max_new_tokens=1, cpu_threads=1)


def test_the_variables_each_torch_reads():
    """The kit sets the name every torch honours on CUDA; torch 2.9.1 ignored the newer name there (pytorch issue
    183387), torch 2.13 reads the old name first."""
    assert variable() == OLD
    assert names_read("2.13.0+cpu") == (OLD, NEW) and names_read("2.11.0") == (OLD, NEW)
    assert names_read("2.9.1+cu128") == (OLD,) and names_read("2.6.0") == (OLD,)
    assert in_effect({NEW: DEFAULT}, "2.9.1") == {"variable": None, "value": "", "expandable_segments": False,
                                                   "ignored": [NEW]}


def test_the_order_is_the_installed_torch_s_own():
    """Ask the installed torch which value its allocator config parsed, for each way a user can set the two."""
    cases = [{OLD: "expandable_segments:True", NEW: "max_split_size_mb:64"}, {NEW: "max_split_size_mb:64"},
             {OLD: "", NEW: "max_split_size_mb:64"}, {OLD: "max_split_size_mb:128"}]
    for case in cases:
        env = {k: v for k, v in os.environ.items() if k not in (NEW, OLD)}
        read = subprocess.run([sys.executable, "-c", "import torch; print(torch._C._accelerator_getAllocatorSettings())"],
                              env={**env, **case}, capture_output=True, text=True, check=True).stdout.strip()
        assert in_effect(case)["value"] == read, case


def test_default_is_set_only_where_the_user_set_nothing():
    env = {}
    rec = apply_default(env, "2.13.0")
    assert env == {OLD: DEFAULT} and rec["variable"] == OLD and rec["expandable_segments"]
    assert rec["set_by"] == "lora_kit"
    old_torch = {}
    apply_default(old_torch, "2.6.0")
    assert old_torch == {OLD: DEFAULT}
    user = {NEW: "max_split_size_mb:128"}  # torch >= 2.11 reads the newer name when the old one is unset
    rec = apply_default(user, "2.13.0")
    assert user == {NEW: "max_split_size_mb:128"}
    assert (rec["variable"], rec["expandable_segments"], rec["set_by"]) == (NEW, False, "environment")
    empty = {OLD: ""}  # set but empty: torch's defaults, the user's choice
    assert apply_default(empty, "2.13.0")["expandable_segments"] is False and empty == {OLD: ""}
    assert in_effect({OLD: "expandable_segments:True,expandable_segments:False"}, "2.13.0")["expandable_segments"] is False


def _child(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in (NEW, OLD)}
    env.update(env_extra, WORLD_SIZE="1")
    code = ("import os; from lora_kit.run import distributed as d; d.init_if_launched(); "
            f"print(os.environ.get({NEW!r}), os.environ.get({OLD!r}))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_a_launched_rank_sets_it_unless_the_user_did():
    assert _child({}) == ["None", DEFAULT]
    assert _child({NEW: "max_split_size_mb:128"}) == ["max_split_size_mb:128", "None"]


def test_accelerate_config_says_how_to_launch_with_it(tmp_path):
    path = write_accelerate_config(tmp_path / "accelerate.yaml", sharding="fsdp", num_gpus=2)
    text = path.read_text()
    assert f"{variable()}={DEFAULT}" in text and yaml.safe_load(text)["distributed_type"] == "FSDP"


def test_smoke_run_records_the_setting_in_effect(tmp_path, monkeypatch):
    monkeypatch.setenv(NEW, "x")  # registers the undo; then start with neither variable set
    monkeypatch.setenv(OLD, "x")
    monkeypatch.delenv(NEW)
    monkeypatch.delenv(OLD)
    smoke_run(run_dir=str(tmp_path / "a"), progress=False, simulate=False, **FAST)
    rec = json.loads((tmp_path / "a" / "smoke" / "smoke.json").read_text())
    assert rec["allocator"]["expandable_segments"] and rec["allocator"]["variable"] == variable()
    assert rec["allocator"]["set_by"] == "lora_kit"
    assert os.environ[variable()] == DEFAULT
    monkeypatch.delenv(variable())
    monkeypatch.setenv(NEW, "max_split_size_mb:64")
    smoke_run(run_dir=str(tmp_path / "b"), progress=False, simulate=False, **FAST)
    rec = json.loads((tmp_path / "b" / "smoke" / "smoke.json").read_text())["allocator"]
    assert (rec["variable"], rec["value"], rec["expandable_segments"]) == (NEW, "max_split_size_mb:64", False)
    assert rec["set_by"] == "environment"
    assert rec["cuda_started_before"] is False and OLD not in os.environ
