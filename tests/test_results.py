"""Atomic result files: complete or absent, readable by others, NaN written as null."""
from __future__ import annotations

import json
import stat

import pytest

from lora_kit.results import read_json, write_json_atomic


def test_json_written_whole_and_shareable(tmp_path):
    p = write_json_atomic(tmp_path / "sub" / "r.json", {"a": 1, "nan": float("nan"), "path": tmp_path})
    assert read_json(p) == {"a": 1, "nan": None, "path": str(tmp_path)}
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert [x.name for x in p.parent.iterdir()] == ["r.json"]  # no temp file left behind


def test_failed_write_keeps_the_previous_file(tmp_path):
    p = write_json_atomic(tmp_path / "r.json", {"phase": "train"})

    class Boom:
        def to_dict(self):
            raise RuntimeError("serialization failed")
    with pytest.raises(RuntimeError):
        write_json_atomic(p, {"x": Boom()})
    assert json.loads(p.read_text()) == {"phase": "train"}
    assert [x.name for x in tmp_path.iterdir()] == ["r.json"]
