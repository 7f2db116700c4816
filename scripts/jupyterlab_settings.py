"""JupyterLab defaults for a kit that runs offline: no news feed and no update check.

JupyterLab 4 asks on first start, in a toast, whether to fetch the Jupyter news feed ("Ask" is its
default), and checks for updates over the network. Both are noise here and both would reach out to
a website from a machine that is often offline. This merges the two settings into
``<prefix>/share/jupyter/lab/settings/overrides.json`` (a user's own choices in the Settings editor
still win), keeping whatever else the file holds. Usage: ``python scripts/jupyterlab_settings.py``
with the environment's python (scripts/setup.sh, binder/postBuild).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PLUGIN = "@jupyterlab/apputils-extension:notification"
QUIET = {"fetchNews": "false", "checkForUpdates": False}


def main(prefix: str = sys.prefix) -> Path:
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault(PLUGIN, {}).update(QUIET)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
