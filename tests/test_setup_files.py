"""The set-up files outside this environment are complete: conda's environment.yml and Binder list every
runtime dependency of the package, torch comes from the CPU index there, and setup.sh prefers it."""
from __future__ import annotations

import re
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
    assert "~30 % slower" in out and "option_strings" not in out
