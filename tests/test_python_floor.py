"""The Python floor in pyproject.toml (``requires-python``) is checked, not guessed: CI runs one Python (3.11), so
the package's source is read by vermin (static analysis of the syntax, modules and functions each version
added) against the floor it states."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_needs_no_python_newer_than_its_floor():
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    assert vermin, "vermin is not installed: it is in the dev extras (bash scripts/setup.sh installs them)"
    floor = re.search(r'^requires-python\s*=\s*">=\s*(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert floor, "pyproject.toml states no requires-python floor"
    r = subprocess.run([vermin, "-q", "--no-tips", "--eval-annotations",
                        f"-t={floor.group(1)}-", "--violations", str(ROOT / "lora_kit")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"lora_kit needs a newer Python than {floor.group(1)}:\n{r.stdout}{r.stderr}"
    # the check can fail: the same call with a floor below what the code uses reports violations
    low = subprocess.run([vermin, "-q", "--no-tips", "--eval-annotations", "-t=3.8-",
                          "--violations", str(ROOT / "lora_kit")], capture_output=True, text=True, timeout=300)
    assert low.returncode != 0 and "lora_kit" in low.stdout
