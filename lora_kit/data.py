"""Load prompt/response examples from the embedded data, JSONL, CSV or a ``datasets`` folder.

Every loader returns the same thing: a list of ``{"prompt": str, "response": str, "task": str}``
dicts, whatever the source's column names were. Sources:

- ``"tiny:dates"`` (with ``split`` = "train" | "validation" | "test"), ``"tiny:control"``,
  ``"tiny:base_mix"``: the task data shipped with the embedded model (lora_kit/embedded/data);
- a ``.jsonl`` file (one JSON object per line) or a ``.csv`` file (header row);
- a folder written by ``datasets.Dataset.save_to_disk`` (needs the optional ``datasets``
  package; a ``DatasetDict`` folder needs ``split``).

Problems are reported as ValueError saying what to change: a missing file, an empty dataset,
a missing column (the message lists the columns that exist) or rows with an empty prompt or
response (the message gives their row numbers, 1-based, and how many there are). Rows are never
silently dropped: a dataset the user believes has 1,000 rows trains on 1,000 rows.
"""
from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

from lora_kit.embedded.tasks import DATA_DIR

TINY_SOURCES = {"tiny:dates": "dates_{split}.jsonl", "tiny:control": "control.jsonl",
                "tiny:base_mix": "base_mix.jsonl"}
DATES_SPLITS = ("train", "validation", "test")


def _embedded_path(source: str, split: str | None) -> Path:
    if source not in TINY_SOURCES:
        raise ValueError(f"unknown embedded dataset {source!r}; choose one of {', '.join(TINY_SOURCES)}.")
    if source == "tiny:dates":
        split = split or "train"
        if split not in DATES_SPLITS:
            raise ValueError(f"split={split!r} is not valid for 'tiny:dates'; choose one of {', '.join(DATES_SPLITS)}.")
    elif split is not None:
        raise ValueError(f"{source!r} has no splits; pass split=None.")
    return DATA_DIR / TINY_SOURCES[source].format(split=split)


def _read_utf8(path: Path) -> str:
    """The file's text; ValueError naming the file and the line when it is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 text (byte {e.start}); save the file as UTF-8.") from None


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(_read_utf8(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not valid JSON ({e.msg}); fix or remove that line.") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {n} is not a JSON object; each line must be {{\"prompt\": ..., "
                             "\"response\": ...}.")
        rows.append(row)
    return rows


def _read_csv(path: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(_read_utf8(path), newline="")))


def _read_datasets_folder(path: Path, split: str | None) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} looks like a datasets folder, but the `datasets` package is not installed; "
                         "`pip install datasets` or export the data to JSONL.") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise ValueError(f"{path} holds splits {sorted(ds)}; pass split= one of them.")
        ds = ds[split]
    return [dict(r) for r in ds]


def _read_rows(source: str | Path, split: str | None) -> tuple[list[dict], str]:
    if isinstance(source, str) and source.startswith("tiny:"):
        path = _embedded_path(source, split)
        if not path.is_file():
            raise ValueError(f"embedded data file {path} is missing; rebuild it with "
                             "`python scripts/build_tiny_model.py` or reinstall lora_kit.")
        return _read_jsonl(path), source
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"dataset {str(source)!r} does not exist; pass a JSONL/CSV file, a datasets folder, "
                         f"or one of {', '.join(TINY_SOURCES)}.")
    if path.is_dir():
        return _read_datasets_folder(path, split), str(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path), str(path)
    if suffix == ".csv":
        return _read_csv(path), str(path)
    raise ValueError(f"{path} has an unsupported extension {suffix!r}; use .jsonl, .csv or a datasets folder.")


def load_examples(source: str | Path, split: str | None = None, prompt_field: str = "prompt",
                  response_field: str = "response", limit: int | None = None) -> list[dict]:
    """Examples ``[{"prompt", "response", "task"}]`` from ``source`` (see module docstring).

    ``limit`` keeps the first ``limit`` rows (file order; shuffle yourself if order matters).
    The task name is the row's ``task`` field if it has one, else the source name.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}.")
    rows, name = _read_rows(source, split)
    if not rows:
        raise ValueError(f"dataset {name!r} is empty; it needs at least one {prompt_field}/{response_field} row.")
    for field in (prompt_field, response_field):
        missing = [i for i, r in enumerate(rows, 1) if field not in r]
        if missing:
            present = sorted({k for r in rows for k in r})
            raise ValueError(f"dataset {name!r} has no field {field!r} in {len(missing)} row(s) (first: row "
                             f"{missing[0]}); fields that exist: {present}. Set prompt_field/response_field.")
    empty = [i for i, r in enumerate(rows, 1)
             if not str(r[prompt_field] or "").strip() or not str(r[response_field] or "").strip()]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise ValueError(f"dataset {name!r}: {len(empty)} row(s) have an empty {prompt_field!r} or "
                         f"{response_field!r} (rows {shown}, 1-based); fill or remove them.")
    if limit is not None:
        rows = rows[:limit]
    return [{"prompt": str(r[prompt_field]), "response": str(r[response_field]),
             "task": str(r.get("task") or name)} for r in rows]


def mix_examples(task_examples: list[dict], base_examples: list[dict], share: float, seed: int = 0) -> list[dict]:
    """Task examples plus base-task examples making up ``share`` of the result, shuffled.

    With ``n`` task examples and share ``s`` the result holds all ``n`` task examples and
    ``round(n * s / (1 - s))`` base examples (drawn without replacement, so at most all of them).
    Mixing a share of the base tasks back in is the cheap guard against forgetting; the cost is
    proportionally fewer new-task examples per optimizer step. ``share=0`` returns a copy.
    """
    if not 0 <= share < 1:
        raise ValueError(f"share must be in [0, 1), e.g. 0.25 for 25 % base-task examples; got {share!r}.")
    if not task_examples:
        raise ValueError("mix_examples needs at least one task example.")
    n_base = round(len(task_examples) * share / (1 - share))
    if n_base == 0:
        return list(task_examples)
    if not base_examples:
        raise ValueError(f"share={share} needs base examples, but base_examples is empty; pass "
                         "load_examples('tiny:base_mix') or your own.")
    rng = random.Random(seed)
    base = rng.sample(list(base_examples), min(n_base, len(base_examples)))
    mixed = list(task_examples) + base
    rng.shuffle(mixed)
    return mixed
