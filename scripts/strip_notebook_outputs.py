#!/usr/bin/env python3
"""Git clean filter: a notebook without outputs, execution counts or widget state (stdin -> stdout).

Registered by scripts/setup.sh (``git config filter.strip-notebook-outputs.clean ...``) and applied to
``notebooks/*.ipynb`` by .gitattributes, so running the notebooks in JupyterLab never dirties the tracked
files: git sees the stripped version. ``python scripts/strip_notebook_outputs.py FILE...`` strips files in
place instead. Standard library only; the output is written as nbformat writes it (no spurious diffs).
"""
from __future__ import annotations

import json
import sys

CELL_METADATA_DROPPED = ("execution", "ExecuteTime", "collapsed", "scrolled")


def strip(nb: dict) -> dict:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        for key in CELL_METADATA_DROPPED:
            cell.get("metadata", {}).pop(key, None)
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def dumps(nb: dict) -> str:
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def main(paths: list[str]) -> int:
    if not paths:
        sys.stdout.write(dumps(strip(json.loads(sys.stdin.read()))))
        return 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        clean = dumps(strip(json.loads(text)))
        if clean != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
