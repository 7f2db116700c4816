"""Load examples from the embedded data, JSONL, JSON, CSV, Parquet or a ``datasets`` folder, in six formats.

Every loader returns the same thing: a list of ``{"prompt": str, "response": str, "task": str}``
dicts (plus ``"context"``, the messages before the answer, for conversational rows, and ``"text"`` for
language-modelling rows), whatever the source's format and column names were. Sources:

- ``"tiny:dates"`` (with ``split`` = "train" | "validation" | "test"), ``"tiny:control"``,
  ``"tiny:base_mix"``: the task data shipped with the embedded model;
  ``"generic:control"``: ~150 short prompts with unambiguous answers (arithmetic, capitals, unit
  conversions, spelling, dates, simple instructions), the control set for any other model.
  These named sources (:data:`TINY_SOURCES`) are files the package ships in :data:`SHIPPED_DATA_DIR`
  (``lora_kit/embedded/data``): package data, read as files. Nothing here imports the embedded
  room's code (:mod:`lora_kit.embedded.tasks` generates those files and imports this module), so
  every layer can load "tiny:dates" and the import graph still points down only;
- a ``.jsonl`` file (one JSON object per line), a ``.json`` file (a JSON array of objects, or JSON
  Lines), a ``.csv`` file (header row) or a ``.parquet`` file (needs ``pyarrow``); a UTF-8 byte-order
  mark (Excel's "CSV UTF-8") is ignored;
- a folder written by ``datasets.Dataset.save_to_disk`` (needs the optional ``datasets``
  package; a ``DatasetDict`` folder with several splits needs ``split``, the run's ``dataset_split``).

Formats (``data_format``; "auto" picks the one whose fields the rows have, :func:`detect_format`):

- ``"prompt_response"``: any two columns, named by ``prompt_field`` / ``response_field``;
- ``"alpaca"``: ``instruction``, optional ``input`` (appended after a blank line), ``output``;
- ``"messages"``: a list of ``{"role", "content"}`` (TRL / hub style) in ``messages_field``; the
  last message is the assistant's answer, the ones before are the context (which of its assistant turns
  are trained is :class:`lora_kit.prompting.PromptFormat`'s ``train_on``);
- ``"sharegpt"``: a list of ``{"from", "value"}`` turns in ``conversations`` (LLaMA-Factory's and
  axolotl's ShareGPT; ``human``/``gpt``/``system``/... mapped to user/assistant/system);
- ``"prompt_completion"``: TRL's ``prompt`` + ``completion``, both text (standard) or both message lists
  (conversational: the messages are the conversation);
- ``"text"``: TRL's language-modelling ``text``; every token is trained.

Problems are reported as ValueError saying what to change: a missing file, an empty dataset,
a missing column (the message lists the columns that exist and the closest one; a column name that was set
is never replaced by another), a format the rows do not have, or
rows with an empty prompt or response (the message gives their places in the file -- a CSV or JSONL file's
lines, as an editor shows them -- and how many there are). Rows are never silently dropped: a dataset the user
believes has 1,000 rows trains on 1,000 rows.

:func:`split_heldout` holds out a deterministic share of a dataset (by seed; rows whose prompts are
equal after :func:`normalize` stay on one side, so the split is clean by the overlap check's rule).
"""
from __future__ import annotations

import csv
import difflib
import io
import json
import random
import unicodedata
from pathlib import Path

from lora_kit.results import PACKAGE_DIR, write_text_atomic
from lora_kit.settings import DATA_FORMATS as SETTING_FORMATS

# the shipped datasets: package data beside the embedded model (written by scripts/build_tiny_model.py)
SHIPPED_DATA_DIR = PACKAGE_DIR / "embedded" / "data"
TINY_SOURCES = {"tiny:dates": "dates_{split}.jsonl", "tiny:control": "control.jsonl",
                "tiny:base_mix": "base_mix.jsonl", "generic:control": "generic_control.jsonl"}
DATA_FORMATS = tuple(f for f in SETTING_FORMATS if f != "auto")  # the formats a file can be in
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "function_call": "assistant", "observation": "tool", "function": "tool"}
ALPACA_FIELDS = ("instruction", "input", "output")
# the field settings and their defaults: a default name may fall back to a format's usual name ("conversations",
# TRL's "completion"); a name the user gave is used as given, and refused when the file lacks it
FIELD_DEFAULTS = {"prompt_field": "prompt", "response_field": "response", "messages_field": "messages"}
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
    return SHIPPED_DATA_DIR / TINY_SOURCES[source].format(split=split)


def _read_utf8(path: Path) -> str:
    """The file's text; ValueError naming the file and the line when it is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")  # Excel's "CSV UTF-8" starts with a byte-order mark
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 text (byte {e.start}); save the file as UTF-8.") from None


class FileRows(list):
    """Rows read from a file, with ``lines``: where each row sits in ``whole``, 1-based, counted in ``unit``s -- in a
    text file the line the row ends on (CSV counts its header, blank lines are skipped), else its row (a JSON
    array's item) -- so that messages point at the place a user finds in an editor. Examples made from the rows,
    and any subset of them (:func:`take`), keep these places: "row of your file" has this one definition."""

    def __init__(self, rows=(), lines=(), unit: str = "line", whole: str = "the file"):
        super().__init__(rows)
        self.lines, self.unit, self.whole = list(lines), unit, whole


def take(rows, idx) -> list:
    """``[rows[i] for i in idx]`` (0-based), a :class:`FileRows` keeping each row's place when ``rows`` knows it."""
    out = [rows[i] for i in idx]
    if not isinstance(rows, FileRows) or len(rows.lines) != len(rows):
        return out
    return FileRows(out, [rows.lines[i] for i in idx], rows.unit, rows.whole)


def row_refs(rows, numbers: list[int]) -> str:
    """``numbers`` (1-based rows of ``rows``) as a user finds them: their places in the file when ``rows`` knows
    them (:class:`FileRows`: "lines 3, 9 of the file"), else their places in ``rows`` ("rows 2, 8, 1-based")."""
    lines = getattr(rows, "lines", None)
    shown = numbers[:10]
    more = " ..." if len(numbers) > 10 else ""
    if lines and len(lines) == len(rows):
        return (f"{rows.unit}{'s' if len(shown) > 1 else ''} {', '.join(str(lines[n - 1]) for n in shown)}{more} "
                f"of {rows.whole}")
    return f"row{'s' if len(shown) > 1 else ''} {', '.join(map(str, shown))}{more}, 1-based"


def _read_jsonl(path: Path) -> list[dict]:
    rows = FileRows()
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
        rows.lines.append(n)
    return rows


def _read_json(path: Path) -> list[dict]:
    """A ``.json`` file: a JSON array of objects (or ``{"data": [...]}``), else read as JSON Lines."""
    text = _read_utf8(path)
    if not text.lstrip().startswith(("[", "{")):
        return _read_jsonl(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("{"):
            return _read_jsonl(path)  # one object per line
        raise ValueError(f"{path}: line {e.lineno} is not valid JSON ({e.msg}); fix that line.") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            return FileRows([data], [1], "object")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; it must be an array of objects.")
    bad = next((i for i, r in enumerate(data, 1) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: item {bad} of the array is not a JSON object; each item must be "
                         "{\"prompt\": ..., \"response\": ...} or another supported format.")
    return FileRows(data, range(1, len(data) + 1), "item", "the array")


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path} is a Parquet file, but `pyarrow` is not installed; `pip install pyarrow` or "
                         "export the data to JSONL.") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow's own errors: name the file
        raise ValueError(f"{path} cannot be read as Parquet ({e}); re-export it.") from None
    return FileRows(rows, range(1, len(rows) + 1), "row")


def _read_csv(path: Path) -> list[dict]:
    reader, rows = csv.DictReader(io.StringIO(_read_utf8(path), newline="")), FileRows()
    for row in reader:  # DictReader skips blank lines: line_num is the line the row ends on
        rows.append(row)
        rows.lines.append(reader.line_num)
    return rows


def _read_datasets_folder(path: Path, split: str | None) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} looks like a datasets folder, but the `datasets` package is not installed; "
                         "`pip install datasets` or export the data to JSONL.") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split is None or split not in ds:
            raise ValueError(f"{path} holds the splits {sorted(ds)}; set dataset_split (or split=) to one of them.")
        ds = ds[split]
    return FileRows([dict(r) for r in ds], range(1, len(ds) + 1), "row", "the dataset")


def _read_rows(source: str | Path, split: str | None) -> tuple[list[dict], str]:
    if isinstance(source, str) and source in TINY_SOURCES or str(source).startswith("tiny:"):
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
    if suffix == ".jsonl":
        return _read_jsonl(path), str(path)
    if suffix == ".json":
        return _read_json(path), str(path)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path), str(path)
    if suffix == ".csv":
        return _read_csv(path), str(path)
    raise ValueError(f"{path} has an unsupported extension {suffix!r}; use .jsonl, .json, .csv, .parquet "
                     "or a datasets folder.")


def read_source(source: str | Path, split: str | None = None) -> tuple[list[dict], str]:
    """The raw rows of ``source`` (as stored, no format applied) and its display name."""
    rows, name = _read_rows(source, split)
    if not rows:
        raise ValueError(f"dataset {name!r} is empty; it needs at least one example.")
    return rows, name


def _is_messages(msgs) -> bool:
    """A list of role/content messages or ShareGPT from/value turns."""
    return isinstance(msgs, list) and bool(msgs) and isinstance(msgs[0], dict) and (
        {"role", "content"} <= set(msgs[0]) or _is_sharegpt(msgs))


def _is_sharegpt(msgs) -> bool:
    return isinstance(msgs, list) and bool(msgs) and isinstance(msgs[0], dict) and "from" in msgs[0] and "value" in msgs[0]


def _matching_format(rows: list[dict], prompt_field: str = "prompt", messages_field: str = "messages",
                     response_field: str = "response") -> str | None:
    """The format whose fields the first row has (the configured names first, then the usual ones), or None."""
    keys = set(rows[0]) if rows else set()
    first = rows[0] if rows else {}
    if prompt_field in keys and response_field in keys:
        return "prompt_completion" if isinstance(first.get(prompt_field), list) else "prompt_response"
    for f in (messages_field, "conversations", "messages"):
        if f in keys and prompt_field not in keys:
            return "sharegpt" if _is_sharegpt(first.get(f)) else "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if prompt_field not in keys and {"instruction", "output"} <= keys:
        return "alpaca"
    if "text" in keys and prompt_field not in keys:
        return "text"
    return None


def detect_format(rows: list[dict], prompt_field: str = "prompt", messages_field: str = "messages",
                  response_field: str = "response") -> str:
    """The format the rows are in, from the first row's fields (the configured names first, then the usual ones):

    - "prompt_response": ``prompt_field`` and ``response_field``;
    - "messages" / "sharegpt": ``messages_field`` or ``conversations`` holding ``role``/``content`` (TRL, hub) or
      ``from``/``value`` (ShareGPT: LLaMA-Factory's and axolotl's) messages;
    - "prompt_completion": TRL's ``prompt`` + ``completion``, strings (standard) or message lists (conversational);
    - "alpaca": ``instruction`` + ``output``;
    - "text": TRL's ``text`` (language modelling: every token trained);
    - else the format the configured names point at: "messages" when ``messages_field`` was changed from
      "messages" and ``prompt_field`` / ``response_field`` were not, "prompt_response" otherwise (whose check then
      names the missing field, the fields that exist and the closest one).
    """
    found = _matching_format(rows, prompt_field, messages_field, response_field)
    if found:
        return found
    if messages_field != FIELD_DEFAULTS["messages_field"] and (prompt_field, response_field) == (
            FIELD_DEFAULTS["prompt_field"], FIELD_DEFAULTS["response_field"]):
        return "messages"
    return "prompt_response"


def load_examples(source: str | Path, split: str | None = None, prompt_field: str = "prompt",
                  response_field: str = "response", limit: int | None = None, data_format: str = "auto",
                  messages_field: str = "messages", usual_names: bool = False) -> list[dict]:
    """Examples ``[{"prompt", "response", "task"[, "context"]}]`` from ``source`` (see module docstring).

    ``limit`` keeps the first ``limit`` rows (file order; shuffle yourself if order matters).
    The task name is the row's ``task`` field if it has one, else the source name.
    ``usual_names``: see :func:`to_examples`.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}.")
    rows, name = read_source(source, split)
    out = to_examples(rows, name, prompt_field, response_field, data_format, messages_field, usual_names)
    return take(out, range(min(limit, len(out)))) if limit is not None else out


def _field(keys: set, setting: str, given: str, usual: tuple[str, ...], usual_names: bool) -> str:
    """The field that holds ``setting``: ``given`` when the rows have it; a default name (or any name, with
    ``usual_names``) falls back to the first of ``usual`` the rows have; a name the user gave is kept (and the
    field check refuses it, naming the closest field)."""
    if given in keys or not (usual_names or given == FIELD_DEFAULTS[setting]):
        return given
    return next((f for f in usual if f in keys), given)


def _check_fields(rows: list[dict], name: str, data_format: str, need: dict[str, str | None], fields: tuple) -> None:
    """ValueError when a field the format needs is missing: absent from the file (naming the setting, the fields
    that exist, the closest one, and a format the rows do have), or missing from some rows (naming them).
    ``need``: field -> the setting that names it (None for a format's fixed names); ``fields``: the three names."""
    present = sorted({k for r in rows for k in r})
    absent = [f for f in need if f not in present]
    if absent:
        others = [c for c in present if c not in need]
        chats = [c for c in others if _is_messages(_parse_list(rows[0].get(c)))]  # a column of messages
        said, hints, unsure = [], [], []
        for f in absent:
            close = (difflib.get_close_matches(f, others, n=1) or (chats if need[f] == "messages_field" else []))[:1]
            what = "; ".join(x for x in (need[f], close and f"did you mean {close[0]!r}?") if x)
            said.append(f"{f!r}" + (f" ({what})" if what else ""))
            if need[f] and close:
                hints.append(f"set {need[f]}={close[0]!r}")
            elif need[f]:
                unsure.append(need[f])
        hints += [f"set {'/'.join(unsure)} to the file's field names"] if unsure else []
        hints = hints or [{"alpaca": "Alpaca rows need instruction, optional input, and output",
                           "text": "language-modelling rows need 'text'"}.get(data_format, "rename the fields")]
        other = _matching_format(rows, *fields)
        if other and other != data_format:
            hints[-1] += f", or data_format={other!r} (the rows look like that format)"
        elif chats and data_format not in ("messages", "sharegpt"):
            fmt = "sharegpt" if _is_sharegpt(_parse_list(rows[0][chats[0]])) else "messages"
            hints[-1] += f", or data_format={fmt!r} with messages_field={chats[0]!r} (that field holds messages)"
        hint = "; ".join(hints)
        raise ValueError(f"dataset {name!r} has no field {' nor '.join(said)} for data_format={data_format!r}; "
                         f"fields that exist: {present}. {hint[0].upper() + hint[1:]}.")
    for f in need:
        missing = [i for i, r in enumerate(rows, 1) if f not in r]
        if missing:
            raise ValueError(f"dataset {name!r} has no field {f!r} in {len(missing)} of {len(rows)} rows "
                             f"({row_refs(rows, missing)}) for data_format={data_format!r}; add it to those rows "
                             "or remove them.")


def to_examples(rows: list[dict], name: str = "dataset", prompt_field: str = "prompt",
                response_field: str = "response", data_format: str = "auto",
                messages_field: str = "messages", usual_names: bool = False) -> list[dict]:
    """Raw rows in any of the formats -> ``[{"prompt", "response", "task"[, "context"][, "text"]}]``.

    Rows that are already examples (``prompt``/``response`` plus a ``context`` list, as this function
    returns them) pass through unchanged whatever the field settings, so examples can be re-read.
    A field name that differs from its default (:data:`FIELD_DEFAULTS`) is used as given: rows without it are
    refused, naming the closest field; ``usual_names`` (held-out and control files, whose format is detected on
    their own) lets it fall back to the format's usual name ("conversations", "messages", "completion").
    Problems name the dataset, the row (:func:`row_refs`: its line in a text file) and what to change; the
    examples of a :class:`FileRows` are one too, with the rows' places.
    """
    if not rows:
        raise ValueError(f"dataset {name!r} is empty; it needs at least one {prompt_field}/{response_field} row.")
    fields = (prompt_field, messages_field, response_field)
    if data_format == "auto":
        data_format = detect_format(rows, *fields)
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format={data_format!r} is not valid; choose 'auto' or one of {', '.join(DATA_FORMATS)}.")
    keys = set(rows[0])
    if data_format in ("messages", "sharegpt"):
        messages_field = _field(keys, "messages_field", messages_field, ("conversations", "messages"), usual_names)
    if data_format == "prompt_completion":
        prompt_field = _field(keys, "prompt_field", prompt_field, ("prompt",), usual_names)
        response_field = _field(keys, "response_field", response_field, ("completion",), usual_names)
    named = {"prompt_field": prompt_field, "response_field": response_field, "messages_field": messages_field}
    need = {"prompt_response": ("prompt_field", "response_field"), "alpaca": ("instruction", "output"),
            "messages": ("messages_field",), "sharegpt": ("messages_field",),
            "prompt_completion": ("prompt_field", "response_field"), "text": ("text",)}[data_format]
    _check_fields(rows, name, data_format, {named.get(f, f): f if f in named else None for f in need}, fields)
    out = []
    for i, r in enumerate(rows, 1):
        try:
            out.append(_example(r, name, data_format, prompt_field, response_field, messages_field))
        except ValueError as e:
            raise ValueError(f"dataset {name!r}, {row_refs(rows, [i])}: {e}") from None
    empty = [i for i, e in enumerate(out, 1) if ("text" in e and not e["text"].strip())
             or ("text" not in e and (not e["prompt"].strip() or not e["response"].strip()))]
    if empty:
        what = {"prompt_response": f"{prompt_field!r} or {response_field!r}", "alpaca": "'instruction' or 'output'",
                "messages": "prompt or final assistant answer", "sharegpt": "prompt or final assistant answer",
                "prompt_completion": "prompt or completion", "text": "'text'"}[data_format]
        raise ValueError(f"dataset {name!r}: {len(empty)} row(s) have an empty {what} ({row_refs(rows, empty)}); "
                         "fill or remove them.")
    if isinstance(rows, FileRows):  # each example keeps its row's place in the file
        return FileRows(out, rows.lines, rows.unit, rows.whole)
    return out


def _text(v) -> str:
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def _parse_list(v):
    if isinstance(v, str):  # a CSV / Parquet cell holding JSON
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return None
    return list(v) if isinstance(v, tuple) else v


def _conversation(msgs: list, field: str) -> dict:
    """An example from a list of role/content messages ending with the assistant's answer."""
    bad = (f"{field!r} must be a list of {{'role', 'content'}} messages ending "
           "with the assistant's answer, after at least one user message")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                         for m in msgs):
        raise ValueError(bad + f"; got {str(msgs)[:80]!r}.")
    if msgs[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in msgs[:-1]):
        raise ValueError(bad + f"; its roles are {[m['role'] for m in msgs]}.")
    context = [{"role": str(m["role"]), "content": _text(m["content"])} for m in msgs[:-1]]
    users = [m for m in context if m["role"] == "user"]
    prompt = users[0]["content"] if len(context) == 1 else "\n".join(f"{m['role']}: {m['content']}" for m in context)
    return {"prompt": prompt, "response": _text(msgs[-1]["content"]), "context": context}


def _example(r: dict, name: str, fmt: str, prompt_field: str, response_field: str, messages_field: str) -> dict:
    """One row as an example; a ValueError says what is wrong with it (:func:`to_examples` names the row)."""
    task = _text(r.get("task")) or name
    if fmt == "prompt_response":
        if isinstance(r.get("text"), str) and not _text(r.get(prompt_field)):  # a text example this module wrote
            return {"prompt": "", "response": "", "text": r["text"], "task": task}
        e = {"prompt": _text(r[prompt_field]), "response": _text(r[response_field]), "task": task}
        if isinstance(r.get("context"), list):  # an example this module wrote: keep its conversation
            e["context"] = r["context"]
        return e
    if fmt == "alpaca":
        extra = _text(r.get("input")).strip()
        return {"prompt": _text(r["instruction"]) + (f"\n\n{extra}" if extra else ""), "response": _text(r["output"]),
                "task": task}
    if fmt == "text":
        return {"prompt": "", "response": "", "text": _text(r["text"]), "task": task}
    if fmt == "prompt_completion":
        p, c = _parse_list(r[prompt_field]) if not isinstance(r[prompt_field], str) else r[prompt_field], r[response_field]
        c = _parse_list(c) if not isinstance(c, str) else c
        if isinstance(p, str) and isinstance(c, str):
            return {"prompt": p, "response": c, "task": task}
        if isinstance(p, list) and isinstance(c, list):  # TRL's conversational prompt/completion
            return {**_conversation(p + c, f"{prompt_field} + {response_field}"), "task": task}
        raise ValueError(f"{prompt_field!r} and {response_field!r} must both be text "
                         f"(standard) or both lists of messages (conversational); got {type(p).__name__} and "
                         f"{type(c).__name__}.")
    msgs = _parse_list(r[messages_field])
    if fmt == "sharegpt":
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "from" in m and "value" in m for m in msgs):
            raise ValueError(f"{messages_field!r} must be a ShareGPT list of "
                             f"{{'from', 'value'}} turns; got {str(msgs)[:80]!r}.")
        unknown = [m["from"] for m in msgs if str(m["from"]).lower() not in SHAREGPT_ROLES]
        if unknown:
            raise ValueError(f"ShareGPT role {unknown[0]!r} is not known; use one of "
                             f"{', '.join(SHAREGPT_ROLES)}.")
        msgs = [{"role": SHAREGPT_ROLES[str(m["from"]).lower()], "content": m["value"]} for m in msgs]
    return {**_conversation(msgs, messages_field), "task": task}


def is_conversational(examples: list[dict]) -> bool:
    """True when the examples came from ``messages`` data (they carry their context messages)."""
    return any("context" in e for e in examples)


def normalize(text: str) -> str:
    """Case-folded text without punctuation, symbols or whitespace ("What is 2 + 2?" -> "whatis22")."""
    text = unicodedata.normalize("NFKC", str(text)).casefold()
    return "".join(ch for ch in text if unicodedata.category(ch)[0] not in "PSZ" and not ch.isspace())


def split_heldout(examples: list[dict], fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of ``examples``: about ``fraction`` held out, drawn by ``seed``.

    Examples whose prompts are equal after :func:`normalize` form one group and go to the same side,
    so no held-out prompt occurs in the training part. Both sides keep the dataset's order. At least
    one group goes to each side; a dataset with a single distinct prompt cannot be split (ValueError).
    """
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(normalize(e.get("text") or e["prompt"]), []).append(i)
    keys = list(groups)
    if len(keys) < 2:
        raise ValueError(f"dataset has {len(examples)} row(s) but only {len(keys)} distinct prompt(s): it cannot be "
                         "split into training and held-out parts; set heldout_dataset to a separate file.")
    random.Random(seed).shuffle(keys)
    target = min(max(1, round(len(examples) * fraction)), len(examples) - 1)
    held: list[int] = []
    for k in keys[:-1]:  # the last group always trains
        if len(held) >= target:
            break
        held += groups[k]
    held_set = set(held)
    return [i for i in range(len(examples)) if i not in held_set], sorted(held)


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """``rows`` as JSONL (UTF-8, one object per line), written atomically."""
    return write_text_atomic(Path(path), "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))


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
        return take(task_examples, range(len(task_examples)))
    if not base_examples:
        raise ValueError(f"share={share} needs base examples, but base_examples is empty; pass "
                         "load_examples('tiny:base_mix') or your own.")
    rng = random.Random(seed)
    base = rng.sample(list(base_examples), min(n_base, len(base_examples)))
    mixed = list(task_examples) + base
    rng.shuffle(mixed)
    return FileRows(mixed, range(1, len(mixed) + 1), "row", f"the training rows ({share:.0%} base-task rows mixed in)")


# ----------------------------------------------------------------------------------------------
# the data of a run, from its settings
# ----------------------------------------------------------------------------------------------
EMBEDDED_MODELS = ("tiny", "lora_kit:tiny", "embedded")
SPLIT_DIR = "data"  # <run_dir>/data/{heldout,trained}.jsonl: the rows a run held out and trained on


def control_source(control_dataset: str, model: str) -> str:
    """``control_dataset`` made concrete: "auto" is the embedded model's own control set for "tiny",
    the shipped generic set ("generic:control") for any other model."""
    if control_dataset != "auto":
        return control_dataset
    return "tiny:control" if model in EMBEDDED_MODELS else "generic:control"


def base_mix_source(model: str) -> str | None:
    """The base-task rows ``base_mix`` mixes in for ``model``: the embedded model's own tasks ("tiny:base_mix")
    for the embedded model; None for any other model -- the kit does not know another model's pretraining
    tasks, and mixing the embedded model's tasks into its data would teach it those instead."""
    return "tiny:base_mix" if model in EMBEDDED_MODELS else None


def check_base_mix(s) -> str | None:
    """``base_mix_source(s.model)``; ValueError naming ``base_mix`` when it is set for a model without one."""
    src = base_mix_source(s.model)
    if s.base_mix > 0 and src is None:
        raise ValueError(f"base_mix={s.base_mix} mixes the embedded tiny model's own tasks, which {s.model!r} was "
                         "not trained on; set base_mix=0 and add rows of the tasks your model should keep to "
                         "dataset instead.")
    return src


def field_settings(s, role: str = "train") -> dict:
    """The data-format keyword arguments of :func:`load_examples` from a Settings. ``role``: "train" (``dataset``:
    ``data_format`` as set) or "heldout" / "control" (their own files: ``heldout_data_format`` /
    ``control_data_format``; "auto" is detected per file, the configured field names tried first, so a held-out
    file in another format than the training file loads: ``usual_names``, :func:`to_examples`)."""
    fmt = s.data_format if role == "train" else getattr(s, f"{role}_data_format")
    return dict(prompt_field=s.prompt_field, response_field=s.response_field, data_format=fmt,
                messages_field=s.messages_field, usual_names=role != "train")


def train_split(s, dataset_split: str | None = None) -> str | None:
    """The split of ``dataset`` that trains: ``dataset_split`` (a DatasetDict folder's split) when set, "train"
    for "tiny:dates" and folders, else None."""
    split = dataset_split if dataset_split is not None else s.dataset_split or None
    if split:
        return split
    return "train" if s.dataset == "tiny:dates" or Path(str(s.dataset)).is_dir() else None


def run_data(s, dataset_split: str | None = None) -> dict:
    """Training and held-out examples of a run (``s`` is a :class:`lora_kit.Settings`).

    - ``heldout_dataset`` set: all of ``dataset`` trains, ``heldout_dataset`` is held out (its format detected
      on its own, :func:`field_settings`);
    - ``dataset`` embedded with splits ("tiny:dates"): its "train" split trains, "test" is held out;
    - otherwise: ``heldout_fraction`` of ``dataset`` is held out by ``seed`` (:func:`split_heldout`).
    ``dataset_split``: the split of a DatasetDict folder that trains (default "train" for folders).
    Returns ``{"train", "heldout", "heldout_source", "split"}`` (``split``: how it was made); the examples of a
    file keep their rows' places in it (:class:`FileRows`), so messages about a training row name its line.
    """
    fields = field_settings(s)
    embedded_split = isinstance(s.dataset, str) and s.dataset == "tiny:dates"
    train = load_examples(s.dataset, split=train_split(s, dataset_split), **fields)
    if s.heldout_dataset:
        return {"train": train, "heldout": load_examples(s.heldout_dataset, **field_settings(s, "heldout")),
                "heldout_source": s.heldout_dataset, "split": "heldout_dataset"}
    if embedded_split:
        return {"train": train, "heldout": load_examples(s.dataset, split="test", **fields),
                "heldout_source": f"{s.dataset}:test", "split": "embedded test split"}
    keep, held = split_heldout(train, s.heldout_fraction, s.seed)
    return {"train": take(train, keep), "heldout": take(train, held),
            "heldout_source": f"{s.dataset} (heldout_fraction={s.heldout_fraction}, seed={s.seed})",
            "split": f"{len(held)} of {len(train)} rows held out by seed {s.seed}"}


def write_run_data(run_dir: str | Path, name: str, examples: list[dict]) -> Path:
    """``<run_dir>/data/<name>.jsonl``: examples as this module returns them (re-readable by load_examples)."""
    return write_jsonl(Path(run_dir) / SPLIT_DIR / f"{name}.jsonl", examples)


def run_data_file(run_dir: str | Path, name: str) -> Path | None:
    p = Path(run_dir) / SPLIT_DIR / f"{name}.jsonl"
    return p if p.is_file() else None


def absolute_paths(s) -> dict:
    """The settings that name existing local files or folders (model, dataset, heldout_dataset,
    control_dataset), made absolute: notebooks run with the run folder as working directory, so a
    path relative to where ``lora-kit run`` was started must not be read relative to the run folder."""
    out = {}
    for name in ("model", "dataset", "heldout_dataset", "control_dataset"):
        v = getattr(s, name)
        if isinstance(v, str) and v and ":" not in v and v not in EMBEDDED_MODELS and Path(v).expanduser().exists():
            out[name] = str(Path(v).expanduser().resolve())
    return out


LONG_SHARE_WARN = 0.03  # above this share of long examples, the run card lists it under "check next"


def long_examples_line(report: dict) -> str:
    """One line on the examples longer than ``seq_len`` (the data report of :func:`verified_slice`)."""
    lx = report.get("long_examples") or {}
    if not lx:
        return ""
    if not lx["count"]:
        return f"data: {report['rows']} rows, none longer than seq_len={lx['seq_len']} (longest {lx['longest_tokens']} tokens)"
    done = {"truncate": f"truncated ({lx['answer_cut_away']} lost their whole answer and were skipped)",
            "drop": "dropped", "error": "refused"}[lx["policy"]]
    warn = "  <- check: above a few percent" if lx["share"] > LONG_SHARE_WARN else ""
    return (f"data: {lx['count']} of {report['rows']} rows ({lx['share']:.1%}) longer than seq_len={lx['seq_len']} "
            f"(longest {lx['longest_tokens']} tokens, {longest_row_words(lx)}): {done} "
            f"[long_examples={lx['policy']!r}]{warn}")


def refuse_long_examples(examples, lengths: list[int], seq_len: int) -> None:
    """``long_examples="error"``: a ValueError when an example (``lengths``: each one's tokens in the run's prompt
    format) is longer than ``seq_len``, saying how many, where (:func:`row_refs`: their lines in the user's file when
    ``examples`` knows them) and how long the longest is. The smoke run (:func:`lora_kit.run.batches.verified_slice`)
    and the checks before it (:func:`lora_kit.data_check.check_long_examples`) refuse with this one message."""
    long_rows = [i + 1 for i, n in enumerate(lengths) if n > seq_len]
    if not long_rows:
        return
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    raise ValueError(f"{len(long_rows)} of {len(lengths)} examples ({len(long_rows) / len(lengths):.1%}) are longer "
                     f"than seq_len={seq_len} ({row_refs(examples, long_rows)}; longest: {lengths[longest]} tokens, "
                     f"{row_refs(examples, [longest + 1])}); raise seq_len, or set long_examples='truncate' or 'drop'.")


def longest_row_words(lx: dict) -> str:
    """Where the longest example is, as :func:`row_refs` named it (``longest_at``; its line in the user's file)."""
    return lx.get("longest_at") or f"row {lx['longest_row'] + 1} of the training rows"
