"""Every file a run reads, loaded and formatted once, before any model is loaded.

:func:`check_data` is what ``lora-kit check`` and notebook 00 run on a run's settings: the training
``dataset`` (its ``dataset_split``), ``heldout_dataset``, ``control_dataset`` (the user's file; the shipped
sets are the package's) and, for the embedded model, ``base_mix``'s rows. Each is read with
:func:`lora_kit.data.load_examples` (the loader the run uses, so the same messages) and, when the model's
tokenizer loads, every row is rendered and tokenised in the run's prompt format
(:class:`lora_kit.prompting.PromptFormat`) -- a chat template that refuses a row (roles that do not
alternate, a system message it raises on) is caught here, not minutes into the run, and so is a training row
longer than ``seq_len`` under ``long_examples="error"`` (:func:`check_long_examples`), and a training set none of
whose rows keeps a trained token within ``seq_len`` (the smoke run's "no usable example"). The first problem is a
ValueError naming the file, the row (:func:`lora_kit.data.row_refs`: its line in the file) and the fix; a clean
check returns one line per file. Cost: one tokenisation per row (the training rows once more under
``long_examples="error"``); no model weights are read.
"""
from __future__ import annotations

from lora_kit.data import (EMBEDDED_MODELS, check_base_mix, control_source, detect_format, field_settings,
                           is_conversational, load_examples, read_source, refuse_long_examples, row_refs,
                           run_data, train_split)


def _files(s, dataset_split: str | None) -> list[tuple[str, str, str | None, dict]]:
    """(role, source, split, load_examples field keywords) of every file the run reads."""
    out = [("dataset", s.dataset, train_split(s, dataset_split), field_settings(s))]
    if s.heldout_dataset:
        out.append(("heldout_dataset", s.heldout_dataset, None, field_settings(s, "heldout")))
    elif s.dataset == "tiny:dates":
        out.append(("heldout_dataset", s.dataset, "test", field_settings(s)))
    ctl = control_source(s.control_dataset, s.model)
    out.append(("control_dataset", ctl, None, {} if ctl.startswith(("tiny:", "generic:")) else
                field_settings(s, "control")))
    mix = check_base_mix(s)
    if s.base_mix > 0 and mix:
        out.append(("base_mix", mix, None, {}))
    return out


def check_data(s, tokenizer=None, dataset_split: str | None = None, train_on: str | None = None,
               load_tokenizer: bool = True) -> dict:
    """Load and format every file of the run ``s`` (a :class:`lora_kit.Settings`); ValueError at the first problem.

    ``tokenizer``: the model's tokenizer (loaded from ``s.model`` when None and ``load_tokenizer``; a tokenizer
    that cannot load skips the tokenising part and says so). Returns ``{"files": [{"role", "source", "rows",
    "format", "conversational"}], "prompt_format", "notes", "lines"}``.
    """
    from lora_kit.prompting import PromptFormat, cut_at_seq_len, no_usable_example, resolve_prompt_format
    train_on = train_on or s.train_on
    files, notes = [], []
    loaded = []
    for role, source, split, fields in _files(s, dataset_split):
        try:
            rows = load_examples(source, split=split, **fields)
        except ValueError as e:
            raise ValueError(f"{role} ({source}): {e}") from None
        raw, _ = read_source(source, split)
        fmt_name = fields.get("data_format", "auto")
        if fmt_name == "auto":
            fmt_name = detect_format(raw, fields.get("prompt_field", "prompt"), fields.get("messages_field", "messages"),
                                     fields.get("response_field", "response"))
        files.append({"role": role, "source": str(source), "split": split, "rows": len(rows), "format": fmt_name,
                      "conversational": is_conversational(rows)})
        loaded.append((role, source, rows))
    if tokenizer is None and load_tokenizer:
        try:
            from lora_kit.loading import load_tokenizer as _load
            tokenizer = _load(s.model, trust_remote_code=s.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - an unreachable hub model: the loading check says why
            notes.append(f"rows not tokenised: the tokenizer of {s.model!r} did not load ({e})")
    kind = None
    if tokenizer is not None:
        kind = resolve_prompt_format(s.prompt_format, tokenizer, is_conversational(loaded[0][2]))
        fmt = PromptFormat(tokenizer, kind, train_on=train_on)
        notes += fmt.notes
        for role, source, rows in loaded:
            cut, shortest = dict.fromkeys(("kept", "dropped", "cut_away"), 0), None  # the smoke run's cut, per row
            for i, ex in enumerate(rows, 1):
                try:
                    enc = fmt.encode(ex)
                except ValueError as e:
                    raise ValueError(f"{role} ({source}), {row_refs(rows, [i])}: {e}") from None
                if role == "dataset" and not any(t != -100 for t in enc["labels"]):
                    raise ValueError(f"{role} ({source}), {row_refs(rows, [i])}: no token is trained "
                                     f"(train_on={train_on!r}); check the row's answer.")
                if role == "dataset":
                    shortest = min(enc["length"], shortest or enc["length"])
                    cut[cut_at_seq_len(enc, s.seq_len, s.long_examples)] += 1
            if role == "dataset" and rows and not cut["kept"] and s.long_examples != "error":  # error: refused below
                why = no_usable_example(cut["dropped"], cut["cut_away"], s.seq_len)
                raise ValueError(f"{role} ({source}): {why} (the shortest is {shortest} tokens; the smoke run would "
                                 "refuse them); raise seq_len.")
        check_long_examples(s, tokenizer, dataset_split, train_on)
    lines = [f"{f['role']}: {f['source']}{':' + f['split'] if f['split'] else ''} -- {f['rows']} rows, "
             f"format {f['format']}" for f in files]
    if kind:
        lines.append(f"prompt format: {kind}" + (f", train_on={train_on}" if kind == "chat" else ""))
    lines += [f"note: {n}" for n in notes]
    return {"files": files, "prompt_format": kind, "notes": notes, "lines": lines,
            "embedded": s.model in EMBEDDED_MODELS}


def check_long_examples(s, tokenizer=None, dataset_split: str | None = None, train_on: str | None = None) -> None:
    """``long_examples="error"``: the smoke run's refusal (:func:`lora_kit.data.refuse_long_examples`) of the
    training rows (:func:`lora_kit.data.run_data`) longer than ``seq_len``, before anything runs: each row tokenised
    once in the run's prompt format, as the smoke run encodes it. ValueError naming ``dataset`` and the rows' lines.
    ``tokenizer``: the model's (loaded from ``s.model`` when None; one that does not load skips the check, and
    :func:`check_data` says why)."""
    if s.long_examples != "error":
        return
    from lora_kit.prompting import PromptFormat, resolve_prompt_format
    if tokenizer is None:
        try:
            from lora_kit.loading import load_tokenizer
            tokenizer = load_tokenizer(s.model, trust_remote_code=s.trust_remote_code)
        except Exception:  # noqa: BLE001 - an unreachable hub model: check_data's note says why
            return
    train = run_data(s, dataset_split)["train"]
    fmt = PromptFormat(tokenizer, resolve_prompt_format(s.prompt_format, tokenizer, is_conversational(train)),
                       train_on=train_on or s.train_on)
    try:
        refuse_long_examples(train, [fmt.encode(ex)["length"] for ex in train], s.seq_len)
    except ValueError as e:
        raise ValueError(f"dataset ({s.dataset}): {e}") from None


def data_problem(s, **kw) -> str | None:
    """:func:`check_data`'s first problem as one line, or None when every file loads and formats."""
    try:
        check_data(s, **kw)
    except ValueError as e:
        return str(e)
    return None


__all__ = ["check_data", "check_long_examples", "data_problem"]
