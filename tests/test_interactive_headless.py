"""One behaviour in JupyterLab and under ``lora-kit run``: where results go, CPU threads, progress, what
papermill injects, and the libraries' known-harmless messages (issue 13, items 5-6). Fast: no kernel
starts here; the main job (tests/test_pipeline.py) checks the same things on real executed notebooks."""
from __future__ import annotations

import ast
import importlib.util
import logging
import warnings
from pathlib import Path

import nbformat
import pytest

from lora_kit import noise, progress
from lora_kit.results import entered_run, new_run, write_json_atomic
from lora_kit.settings import Settings, field_names, from_dict, load_settings
from lora_kit.ui import notebook
from lora_kit.ui.run_card import build_report
from lora_kit.ui.pipeline import PIPELINE, TrackedKernelManager, injected_parameters, notebooks_dir

ROOT = Path(__file__).resolve().parents[1]


def test_interactive_session_writes_the_run_layout_and_builds_its_card(tmp_path, monkeypatch):
    import torch
    monkeypatch.delenv("LORA_KIT_RUNS_BASE", raising=False)
    monkeypatch.chdir(notebooks_dir())  # JupyterLab runs a notebook's kernel in its folder
    assert notebook.runs_base() == ROOT  # so "runs/default" is the checkout's runs/default, as lora-kit run's
    monkeypatch.setenv("LORA_KIT_RUNS_BASE", str(tmp_path))  # this test's own "checkout"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        S = notebook.setup({"run_dir": "runs/default", "interactive": True})
        assert S.run_dir == str(tmp_path / "runs" / "default") and (tmp_path / "runs/default/figures").is_dir()
        assert torch.get_num_threads() == 1  # the tiny model: one thread, as headless
    finally:
        torch.set_num_threads(before)
    write_json_atomic(f"{S.run_dir}/stack.json", {"probes": [], "verdict": {"blocking": []}})
    paths = build_report(S.run_dir)  # what 04's last cell does in an interactive session
    assert Path(paths["md"]) == tmp_path / "runs/default/report.md" and Path(paths["md"]).read_text()


def test_threads_follow_omp_num_threads_and_real_models_keep_torchs(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert notebook.cpu_threads(Settings()) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert notebook.cpu_threads(Settings(model="llama-3.1-8b")) is None


def _declared(nb_path: Path) -> dict:
    cell = next(c for c in nbformat.read(nb_path, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    return {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body}


@pytest.mark.parametrize("params_file", sorted((ROOT / "params").glob("*.yaml")), ids=lambda p: p.stem)
def test_injected_parameters_rebuild_exactly_the_runs_settings(params_file):
    """papermill injects only what differs from the notebook's own values; the kernel's ``setup`` then
    validates the same settings as the run's, for every notebook and every shipped params file."""
    params = load_settings(params_file).replace(run_dir="/abs/runs/x", interactive=False).to_dict()
    for name in PIPELINE:
        injected = injected_parameters(notebooks_dir() / name, params)
        namespace = {**_declared(notebooks_dir() / name), **injected}
        assert from_dict({k: namespace[k] for k in field_names() if k in namespace}).to_dict() == params, name
        assert {"run_dir", "interactive"} <= set(injected) and len(injected) < len(params)


def test_default_run_injects_two_lines():
    params = Settings().replace(run_dir="/abs/runs/default", interactive=False).to_dict()
    assert injected_parameters(notebooks_dir() / PIPELINE[3], params) == {"run_dir": "/abs/runs/default",
                                                                         "interactive": False}


def test_kernels_talk_over_local_sockets():
    assert TrackedKernelManager(kernel_name="python3").transport == "ipc"


def test_headless_progress_lines_reach_the_terminal(tmp_path):
    printed = []
    with entered_run(new_run("test", tmp_path)):
        stop = progress.follow(tmp_path, printed.append, poll_s=0.05)
        bar = progress.bar(4, "smoke steps", enabled=False, run_dir=tmp_path / "smoke", every_s=0)
        for _ in range(4):
            bar.set_postfix(loss="0.5000")
            bar.update(1)
        bar.close()
        stop()
    assert printed[0].startswith("      smoke steps: 1/4 steps (25%)") and "left, loss 0.5000" in printed[0]
    assert printed[-1].startswith("      smoke steps: 4/4 steps (100%)") and len(printed) == 4
    # outside a lora-kit run and without a bar: nothing is written anywhere
    quiet_bar = progress.bar(4, "x", enabled=False, run_dir=tmp_path)
    quiet_bar.update(4)
    quiet_bar.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress.log"]


def test_known_harmless_warnings_are_silenced_and_nothing_else(recwarn):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import bitsandbytes as bnb
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        noise.quiet()
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2))
        model.is_gradient_checkpointing  # noqa: B018 - peft reads this deprecated alias
        p = torch.nn.Parameter(torch.randn(64, 64))
        p.grad = torch.ones_like(p)
        bnb.optim.PagedAdamW8bit([p]).step()  # on CPU: "Paged optimizers are not supported on CPU"
        warnings.warn("an unrelated FutureWarning", FutureWarning)
    assert [str(w.message) for w in seen if not str(w.message).startswith("an unrelated")] == []
    assert [str(w.message) for w in seen] == ["an unrelated FutureWarning"]


@pytest.mark.parametrize("logger_name", sorted(noise.LOGS))
def test_silenced_log_messages_exist_verbatim_in_the_installed_libraries(logger_name, caplog):
    start, _why = noise.LOGS[logger_name]
    source = Path(importlib.util.find_spec(logger_name).origin).read_text()
    assert start in source, f"{logger_name} no longer says {start!r}: update lora_kit.noise.LOGS"
    noise.quiet()
    with caplog.at_level(logging.WARNING, logger=logger_name):
        logging.getLogger(logger_name).warning(start + " (as the library words it)")
        logging.getLogger(logger_name).warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == logger_name] == ["something else"]


def test_the_python_api_is_quiet_only_while_it_runs(caplog):
    """``quieted`` (what ``lora_kit.simulate`` runs under) silences the known messages inside the block and leaves
    the caller's warning filters and loggers as they were."""
    name, (start, _why) = next(iter(noise.LOGS.items()))
    logger = logging.getLogger(name)
    filters, log_filters = list(warnings.filters), list(logger.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with noise.quieted(), caplog.at_level(logging.WARNING, logger=name):
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("an unrelated FutureWarning", FutureWarning)
            logger.warning(start + " (as the library words it)")
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    assert [str(w.message) for w in seen] == [  # inside: only the unrelated one; after: the known one shows again
        "an unrelated FutureWarning", "`is_gradient_checkpointing` is deprecated and will be removed in v6."]
    assert [r.getMessage() for r in caplog.records if r.name == name] == []
    assert list(warnings.filters) == filters and list(logger.filters) == log_filters
