"""The set-up files outside this environment are complete: conda's environment.yml and Binder list every
runtime dependency of the package, torch comes from the CPU index there, and setup.sh prefers it."""
from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pip_lines(env_file: Path) -> list[str]:
    env = yaml.safe_load(env_file.read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return [str(x) for x in pip]


def test_env_files_list_every_runtime_dependency_and_the_cpu_torch_index():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {_name(d) for d in deps}
    for env_file in (ROOT / "environment.yml", ROOT / "binder" / "environment.yml"):
        lines = _pip_lines(env_file)
        listed = {_name(x) for x in lines if not x.startswith("-")}
        assert needed <= listed, f"{env_file.relative_to(ROOT)} misses {sorted(needed - listed)}"
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines, env_file


def test_binder_installs_the_package_with_its_dependencies():
    post = (ROOT / "binder" / "postBuild").read_text()
    assert "pip install -e ." in post and "--no-deps" not in post.split("#")[0]


def test_setup_script_prefers_the_cpu_build_off_gpu_machines():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "download.pytorch.org/whl/cpu" in setup and "nvidia-smi" in setup
    assert setup.index('"$TORCH_SPEC"') < setup.index('-e ".[dev]"'), "torch must be installed before the package"


def test_cli_help_prints_every_setting_readably():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "lora_kit.ui.cli", "run", "--help"], capture_output=True, text=True,
                         check=True, env={"COLUMNS": "200", "PATH": ""}).stdout
    from lora_kit.settings import Step
    assert " ".join(Step.doc("gradient_checkpointing").split()) in " ".join(out.split())  # "%" survives argparse
    assert "about 30 % more time" in " ".join(out.split()) and "option_strings" not in out


def _git(*args, cwd):
    import subprocess
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_tracked_notebooks_have_no_outputs():
    import json
    import subprocess
    names = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert names
    for name in names:
        # what git holds (the index: what a commit would store); the file itself in a copy without git
        staged = subprocess.run(["git", "show", f":notebooks/{name}"], cwd=ROOT, capture_output=True, text=True)
        nb = json.loads(staged.stdout if staged.returncode == 0 else (ROOT / "notebooks" / name).read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), f"{name} holds outputs"
        assert "widgets" not in nb["metadata"], f"{name} holds widget state"


def test_outputs_written_by_a_session_do_not_dirty_git(tmp_path):
    """The clean filter that setup.sh registers: a notebook executed in place shows no change to git."""
    import shutil
    import sys

    import nbformat
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "filter.strip-notebook-outputs.clean" in setup
    assert "notebooks/*.ipynb filter=strip-notebook-outputs" in (ROOT / ".gitattributes").read_text()
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / ".gitattributes", repo)
    (repo / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "strip_notebook_outputs.py", repo / "scripts")
    shutil.copy(ROOT / "notebooks" / "00_stack_check.ipynb", repo / "notebooks")
    subprocess_python = f"{sys.executable} scripts/strip_notebook_outputs.py"
    _git("init", "-q", cwd=repo)
    _git("config", "filter.strip-notebook-outputs.clean", subprocess_python, cwd=repo)
    _git("add", ".", cwd=repo)
    _git("commit", "-qm", "notebooks", cwd=repo)
    path = repo / "notebooks" / "00_stack_check.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.execution_count = 7
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="a result\n")]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nbformat.write(nb, path)
    assert "a result" in path.read_text()
    assert _git("diff", cwd=repo) == "", "outputs show as a change"
    # git status lists a file whose size changed until the index is refreshed by `git add` (git skips the
    # filter then, as with nbstripout); adding stores nothing new
    _git("add", "notebooks", cwd=repo)
    assert _git("status", "--porcelain", cwd=repo) == "", "outputs made the notebook look modified"
    code.source += "\n# an edit"  # a real change still shows, without its outputs
    nbformat.write(nb, path)
    assert _git("status", "--porcelain", cwd=repo).strip() == "M notebooks/00_stack_check.ipynb"
    assert "a result" not in _git("diff", cwd=repo)


def test_every_cli_help_renders(capsys):
    """`lora-kit --help` and each subcommand's: a stray `%` in a help string would raise or garble them."""
    import pytest

    from lora_kit.ui.cli import main
    for argv in (["--help"], ["run", "--help"], ["estimate", "--help"], ["check", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        out = capsys.readouterr().out
        assert done.value.code == 0 and "usage: lora-kit" in out and "option_strings" not in out, argv
        assert "%(" not in out and "%%" not in out, argv


def test_jupyterlab_settings_silence_the_news_toast_and_keep_other_overrides(tmp_path):
    """setup.sh and binder write JupyterLab overrides: no news toast, no update check. The values must
    be ones the installed JupyterLab's own schema accepts, and other overrides survive the merge."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import jupyterlab_settings as js
    finally:
        sys.path.pop(0)
    assert "jupyterlab_settings.py" in (ROOT / "scripts" / "setup.sh").read_text()
    assert "jupyterlab_settings.py" in (ROOT / "binder" / "postBuild").read_text()
    overrides = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    overrides.parent.mkdir(parents=True)
    overrides.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    assert js.main(str(tmp_path)) == overrides
    data = json.loads(overrides.read_text())
    assert data["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    schema_dir = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas" / "@jupyterlab" / "apputils-extension"
    props = json.loads((schema_dir / "notification.json").read_text())["properties"]
    for name, value in data[js.PLUGIN].items():
        allowed = props[name]
        if "oneOf" in allowed:
            assert value in [o["const"] for o in allowed["oneOf"]], (name, value)
        else:
            assert isinstance(value, {"boolean": bool, "string": str}[allowed["type"]]), (name, value)
    assert data[js.PLUGIN] == {"fetchNews": "false", "checkForUpdates": False}
