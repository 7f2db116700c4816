"""Nothing of the user's is moved (issue 38, item 1): ``--overwrite`` / ``--resume`` move aside only a folder that
holds a lora_kit run record, never a git checkout's tracked files, and no run is written into the file system
root, a home folder, a checkout's root or ``.git``, or a virtual environment."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lora_kit.results import check_output_dir, new_run
from lora_kit.settings import Settings
from lora_kit.ui.pipeline import prepare_run_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def checkout(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "index.md").write_text("# docs\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "docs"], check=True)
    return repo


def _run_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "pipeline.json").write_text(json.dumps({"run": new_run("lora-kit run", path), "status": "complete",
                                                    "kind": "lora_kit.pipeline"}))
    return path


def test_overwrite_refuses_a_tracked_folder(checkout):
    docs = checkout / "docs"
    for flags in ({"overwrite": True, "resume": False}, {"overwrite": False, "resume": True}):
        with pytest.raises(ValueError, match="never moved aside"):
            prepare_run_dir(docs, Settings().to_dict(), log=print, **flags)
    assert (docs / "index.md").is_file() and not list(checkout.glob("docs.*"))


def test_overwrite_refuses_a_tracked_run_record(checkout):
    run = _run_folder(checkout / "docs")  # a committed run: part of the checkout all the same
    subprocess.run(["git", "-C", str(checkout), "add", "docs"], check=True)
    with pytest.raises(ValueError, match="tracked files"):
        prepare_run_dir(run, Settings().to_dict(), overwrite=True, resume=False, log=print)
    assert (run / "index.md").is_file()


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "a.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a lora_kit run"):
        prepare_run_dir(mine, Settings().to_dict(), overwrite=True, resume=False, log=print)
    assert (mine / "a.jpg").is_file()


def test_overwrite_moves_a_run_aside(checkout):
    run = _run_folder(checkout / "runs" / "mine")  # untracked, like the git-ignored runs/
    prepare_run_dir(run, Settings().to_dict(), overwrite=True, resume=False, log=print)
    aside = list((checkout / "runs").glob("mine.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "pipeline.json").is_file()


@pytest.mark.parametrize("where", ["root", "home", "checkout", "git", "venv"])
def test_output_folder_refuses_protected_places(where, checkout):
    path = {"root": Path("/"), "home": Path.home(), "checkout": checkout, "git": checkout / ".git",
            "venv": ROOT / ".venv"}[where]
    if where == "venv" and not (path / "pyvenv.cfg").is_file():
        pytest.skip("no .venv here")
    with pytest.raises(ValueError, match="must not write there"):
        check_output_dir(path, create=False)


def test_cli_refuses_overwriting_the_checkout(checkout, capsys):
    from lora_kit.ui.cli import main
    assert main(["run", "--runs-dir", str(checkout.parent), "--name", checkout.name, "--overwrite",
                 "--only", "00"]) == 2
    assert "must not write there" in capsys.readouterr().err
    assert (checkout / "docs" / "index.md").is_file()
    assert main(["run", "--runs-dir", str(checkout), "--name", "docs", "--overwrite", "--only", "00"]) == 2
    assert "never moved aside" in capsys.readouterr().err and (checkout / "docs" / "index.md").is_file()


def test_resume_keeps_the_rows_the_kept_smoke_run_trained_and_held_out(tmp_path):
    """A resumed run keeps 03's data/ (trained.jsonl, heldout.jsonl) with 03: 04 evaluates on exactly those held-out
    rows and the card quotes the first trained row; moving them aside would evaluate other rows."""
    run = tmp_path / "runs" / "mine"
    ident = new_run("lora-kit run", run)
    (run / "smoke").mkdir(parents=True)
    (run / "data").mkdir()
    (run / "03_smoke_run.ipynb").write_text("{}")
    (run / "smoke" / "smoke.json").write_text(json.dumps({"run": ident, "status": "complete"}))
    for name in ("trained", "heldout"):
        (run / "data" / f"{name}.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
    (run / "04_evaluate.ipynb").write_text("{}")  # failed in that run: moved aside and run again
    params = Settings().to_dict()
    (run / "pipeline.json").write_text(json.dumps({
        "run": ident, "status": "failed at 04_evaluate.ipynb", "kind": "lora_kit.pipeline", "settings": params,
        "notebooks": [{"notebook": "03_smoke_run.ipynb", "status": "ok"},
                      {"notebook": "04_evaluate.ipynb", "status": "failed"}]}))
    _, kept, _ = prepare_run_dir(run, params, overwrite=False, resume=True, log=print)
    assert [e["notebook"] for e in kept] == ["03_smoke_run.ipynb"]
    assert (run / "data" / "trained.jsonl").is_file() and (run / "data" / "heldout.jsonl").is_file()
    assert not (run / "04_evaluate.ipynb").exists()
    aside = list((tmp_path / "runs").glob("mine.aside-*"))
    assert len(aside) == 1 and (aside[0] / "04_evaluate.ipynb").is_file() and not (aside[0] / "data").exists()


def test_a_folder_of_other_files_is_refused_without_offering_overwrite(tmp_path):
    """A run folder path that holds files but no run: the refusal names another --name, never --overwrite or
    --resume (both refuse such a folder), and nothing in it moves."""
    mine = tmp_path / "runs" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as e:
        prepare_run_dir(mine, Settings().to_dict(), overwrite=False, resume=False, log=print)
    msg = str(e.value)
    assert "not a lora_kit run" in msg and "another --name" in msg, msg
    assert "--overwrite" not in msg and "--resume" not in msg, msg
    assert (mine / "notes.txt").read_text() == "mine" and not list(mine.parent.glob("mine.*"))
