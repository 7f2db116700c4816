"""Base model vs adapter(s) on held-out and control examples: :func:`evaluate`.

A falling training loss does not show that the model got better at the task, so this compares
the base model and each adapter on the *same* examples with the *same* decoding (left-padded
batches, greedy unless ``do_sample``, same ``max_new_tokens``, same stop rules -- EOS or a
newline -- and the same seed before each system), then reports:

- per example and overall: exact match, chrF, and the teacher-forced reference loss (mean NLL
  per response token, prompt masked; perplexity = exp of the token-weighted mean);
- the paired difference adapter - base with a bootstrap interval, better/worse/same counts and a
  sentence over every metric that says "no clear difference" where an interval contains 0;
- behaviour change on the control set (tasks the fine-tune was not about): outputs changed, metric
  change per task, the examples that changed most (regressions first);
- held-out hygiene: prompts shared with the training data (exact or normalized) make the call
  fail unless ``allow_overlap=True``, which marks the result as not held-out.

Trade-offs: the base is loaded once and each adapter is switched on/off on it (peft
``disable_adapter``), so several adapters cost one base in memory, but they must all fit that base.
Greedy decoding is deterministic and what exact match wants; sampling (``do_sample=True``)
measures what users see at temperature > 0 but needs more examples for the same interval width.
Batched generation with left padding is fast but can differ in the last bit from unbatched
generation; base and adapter see identical batches, so the comparison stays fair.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lora_kit.data import control_source, field_settings, is_conversational, load_examples, run_data, run_data_file
from lora_kit.evaluation import compare as C
from lora_kit.evaluation import figures as eval_figures
from lora_kit.evaluation.adapters import load_adapters, local_adapter
from lora_kit.evaluation.hygiene import check_heldout, overlap_report
from lora_kit.generation import generate, reference_nll
from lora_kit.loading import load_model, load_tokenizer, resolve_model
from lora_kit.progress import bar as progress_bar
from lora_kit.prompting import PromptFormat, resolve_prompt_format
from lora_kit.results import (check_output_dir, read_json, read_record, run_identity, settled, write_json_atomic,
                              write_text_atomic)
from lora_kit.run.adapters import trained_adapters
from lora_kit.settings import Settings, _check_int, check_count, check_heldout_split, parse_bool

EVAL_DIR = "eval"


@dataclass
class EvalResult:
    """What :func:`evaluate` returns: ``summary`` (the JSON written to ``eval/eval.json``),
    ``per_example`` (one row per example, written to ``eval/per_example.csv``), ``summary_sentence``
    (held-out sentence, then the control-set sentence) and figure helpers (plotly figures; nothing
    is shown). In the JSON, ``summary_sentence`` is the held-out part and
    ``control.summary_sentence`` / ``control.changed_fraction`` describe the control set."""
    summary: dict
    per_example: pd.DataFrame
    summary_sentence: str
    paths: dict = field(default_factory=dict)

    @property
    def adapters(self) -> list[str]:
        return list(self.summary["adapters"])

    def metric_bars(self, split: str = "heldout"):
        return eval_figures.metric_bars(self, split)

    def diff_histogram(self, adapter: str | None = None, metric: str = "chrf", split: str = "heldout"):
        return eval_figures.diff_histogram(self, adapter, metric, split)

    def control_changes(self, adapter: str | None = None):
        return eval_figures.control_changes(self, adapter)

    def examples_table(self, adapter: str | None = None, split: str | None = None, changed_only: bool = False):
        return eval_figures.examples_table(self, adapter, split, changed_only)

    def figures(self) -> dict:
        return eval_figures.all_figures(self)


def load_result(run_dir: str | os.PathLike) -> EvalResult:
    """The :class:`EvalResult` written by ``evaluate(run_dir=...)``, for figures without re-running."""
    d = Path(run_dir) / EVAL_DIR
    if not (d / "eval.json").is_file():
        raise ValueError(f"no evaluation in {str(d)!r}; run lora_kit.evaluation.evaluate(run_dir={os.fspath(run_dir)!r}) first.")
    summary = read_json(d / "eval.json")
    text = ["split", "task", "prompt", "reference"] + [f"pred:{s}" for s in [C.BASE, *summary["adapters"]]]
    df = pd.read_csv(d / "per_example.csv", dtype={c: str for c in text}, keep_default_na=False)
    sentence = " ".join(x for x in (summary["summary_sentence"], summary["control"].get("summary_sentence")) if x)
    return EvalResult(summary=summary, per_example=df, summary_sentence=sentence,
                      paths={"json": str(d / "eval.json"), "csv": str(d / "per_example.csv")})


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def _rows(source, split: str | None = None, name: str = "heldout", prompt_field: str = "prompt",
          response_field: str = "response", n: int | None = None, data_format: str = "auto",
          messages_field: str = "messages") -> list[dict]:
    """The first ``n`` examples (0/None = all) as ``[{"prompt", "response", "task"}]``.

    ``source``: a list of dicts, a DataFrame, a ``(source, split)`` tuple or a source name/path for
    :func:`lora_kit.data.load_examples`. Which n: the rows in the source's order, taken from each
    ``task`` in turn (round-robin), so a file grouped by task still gives every task its share; a
    single-task split is simply its first n rows. Nothing is resampled.
    """
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], (str, os.PathLike)):
        source, split = source
    if isinstance(source, (str, os.PathLike)):
        rows = load_examples(os.fspath(source), split=split, prompt_field=prompt_field, response_field=response_field,
                             data_format=data_format, messages_field=messages_field)
        prompt_field, response_field = "prompt", "response"
    else:
        rows = source.to_dict("records") if isinstance(source, pd.DataFrame) else [dict(r) for r in source]
    rows = _round_robin(rows)[:n] if n else rows
    if not rows:
        raise ValueError(f"the {name} set is empty; pass a source with examples (or a larger n_{name}).")
    for i, r in enumerate(rows):
        p, ref = r.get(prompt_field), r.get(response_field)
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"{name} example {i} has no prompt in field {prompt_field!r}; "
                             "pass prompt_field=... naming the prompt column.")
        if ref is None or (isinstance(ref, float) and math.isnan(ref)) or not str(ref).strip():
            raise ValueError(f"{name} example {i} has no reference answer in field {response_field!r}: "
                             "evaluation needs a reference for every example; fill it in, drop the example, "
                             "or pass response_field=... naming the answer column.")
    return [{"prompt": r[prompt_field], "response": str(r[response_field]).strip(), "task": str(r.get("task") or name),
             **({"context": r["context"]} if isinstance(r.get("context"), list) else {})} for r in rows]


def _round_robin(rows: list[dict]) -> list[dict]:
    """Rows reordered one task at a time in turn (order kept within each task)."""
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(str(r.get("task")), []).append(r)
    groups = list(by_task.values())
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def _adapters(adapters, run_dir) -> dict[str, str]:
    if adapters is None:  # what the run's notebook 03 trained (lora_kit.run.adapters)
        return trained_adapters(run_dir) if run_dir is not None else {}
    if isinstance(adapters, (str, os.PathLike)):
        adapters = {"adapter": os.fspath(adapters)}
    if not isinstance(adapters, dict):
        raise ValueError("adapters must be a path or a dict {name: path}, e.g. {'r16': 'runs/x/smoke/adapter'}.")
    if C.BASE in adapters:
        raise ValueError(f"{C.BASE!r} names the base model; give the adapter another name.")
    return {str(k): os.fspath(v) for k, v in adapters.items()}


def _check_base_alone(run_dir: Path) -> None:
    """ValueError when the run in ``run_dir`` has a smoke run that did not complete and saved no adapter (killed,
    failed): a base-only evaluation would pass for the run's result."""
    rec = settled(read_record(run_dir / "smoke" / "smoke.json"))
    if rec is not None and rec.get("status") != "complete":
        raise ValueError(f"the smoke run in {str(run_dir / 'smoke')!r} ended {rec.get('status')!r} without saving an "
                         "adapter, so there is nothing to compare with the base. Rerun the smoke run, or pass "
                         "adapters={} to evaluate the base model alone.")


def _adapter_run(name: str, path: str, allow_incomplete: bool) -> dict | None:
    """The smoke run that saved the adapter at ``path`` (its ``smoke.json`` one folder up), or None when
    there is no such record (an adapter from elsewhere). ValueError when that run did not complete."""
    rec = settled(read_record(Path(path).parent / "smoke.json"))
    if rec is None:
        return None
    status = rec.get("status")
    if status != "complete" and not allow_incomplete:
        raise ValueError(f"adapter {name!r} at {path!r}: the smoke run that wrote it says {status!r} "
                         f"({Path(path).parent / 'smoke.json'}), so the adapter may be a leftover of another run or "
                         "unverified. Run the smoke run to completion, or pass allow_incomplete_adapter=True to "
                         "evaluate it anyway.")
    return {"run": rec.get("run"), "status": status}


def _check_lengths(fmt, rows, name, max_new_tokens, context) -> None:
    if not context:
        return
    for i, r in enumerate(rows):
        n_prompt = len(fmt.prompt_ids(r))
        n_ref = fmt.encode(r)["length"]
        need = max(n_prompt + max_new_tokens, n_ref)
        if need > context:
            raise ValueError(
                f"{name} example {i} needs {need} tokens (prompt {n_prompt} + max_new_tokens {max_new_tokens}, "
                f"or {n_ref} with its reference) but the model's context is {context} tokens; shorten or drop "
                f"the example, or lower max_new_tokens.")


# ----------------------------------------------------------------------------------------------
# running the model
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _active(model, system: str):
    """Run ``model`` as the base (adapters disabled) or with one adapter switched on."""
    if not hasattr(model, "disable_adapter"):
        yield
    elif system == C.BASE:
        with model.disable_adapter():
            yield
    else:
        model.set_adapter(system)
        yield


def _run_split(model, tokenizer, split: str, rows: list[dict], systems: list[str], gen: dict, bar,
               timing: dict, fmt) -> pd.DataFrame:
    """Outputs and reference losses of every system on one split, scored (one row per example)."""
    df = pd.DataFrame({"split": split, "task": [r["task"] for r in rows], "index": range(len(rows)),
                       "prompt": [r["prompt"] for r in rows], "reference": [r["response"] for r in rows]})
    for s in systems:
        ts = time.perf_counter()
        if bar is not None:
            bar.set_description(f"{split}: {s}")
        cut: list[bool] = []
        with _active(model, s):
            df[f"pred:{s}"] = generate(model, tokenizer, rows, bar=bar, fmt=fmt, unfinished=cut, **gen)
            nll, ntok = reference_nll(model, tokenizer, rows, df["reference"].tolist(), gen["batch_size"], bar, fmt)
        df[f"ref_nll:{s}"], df["ref_tokens"] = nll, ntok
        df[f"ref_loss:{s}"] = [a / max(b, 1) for a, b in zip(nll, ntok)]
        timing[f"{split}:{s}_wall_s"] = time.perf_counter() - ts
        if any(cut):
            timing.setdefault("think_unfinished", {})[f"{split}:{s}"] = sum(cut)
    return C.score_frame(df, systems)


# ----------------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------------
def evaluate(base_model: str | Settings = "tiny", adapters: str | dict[str, str] | None = None,
             heldout="tiny:dates", heldout_split: str | None = "test", control="tiny:control",
             run_dir: str | os.PathLike | None = None, n_heldout: int | None = 200, n_control: int | None = 200,
             max_new_tokens: int = 16, batch_size: int = 32, seed: int = 0, method: str = "lora",
             dtype: str = "float32", train_examples=None, allow_overlap: bool = False,
             prompt_field: str = "prompt", response_field: str = "response", do_sample: bool = False,
             temperature: float = 1.0, confidence: float = 0.95, n_resamples: int = 2000,
             check_base_name: bool = True, trust_remote_code: bool = False, progress: bool = True,
             device: str | None = None, allow_incomplete_adapter: bool = False, prompt_format: str = "auto",
             data_format: str = "auto", messages_field: str = "messages", attn_implementation: str = "sdpa",
             source_names: dict | None = None, think: str = "answer") -> EvalResult:
    """Compare ``base_model`` with each adapter on held-out and control examples.

    ``evaluate(settings, ...)`` with a :class:`lora_kit.Settings` evaluates that run (see
    :func:`settings_kwargs`: its held-out rows, its control set, the rows it trained on); other
    arguments given beside it override it (an argument left at its default keeps the settings' value).

    Parameters (the rest mirror :class:`lora_kit.Settings`):
        adapters: an adapter folder, ``{name: folder}`` for several, or None (= every adapter the run in
            ``run_dir`` trained, as its ``smoke/smoke.json`` lists them -- the smoke run's and the base-mix
            comparison's, see :func:`lora_kit.run.adapters.trained_adapters`; else ``<run_dir>/smoke/adapter``
            if it exists; else the base model alone).
        heldout / control: a source name or path for ``lora_kit.data.load_examples``, a
            ``(source, split)`` tuple, a list of ``{"prompt", "response"[, "task"]}`` dicts or a
            DataFrame. ``control=None`` skips the control set. Control rows are grouped by ``task``.
        n_heldout / n_control: n examples of each, taken task by task in turn (0 or None = all).
        train_examples: the training data, for the overlap check; None = the ``"train"`` split of
            ``heldout`` when ``heldout`` is a source name (not checked when that does not exist).
        allow_overlap: evaluate even when held-out prompts occur in training; the result is then
            marked ``summary["heldout"]["is_heldout"] = False`` and the sentence says so.
        method: "lora" (base in ``dtype``) or "qlora" (4-bit NF4 base, as it was trained).
        prompt_format: "auto" (chat template for conversational data when the tokenizer has one, else
            plain), "plain", "chat" or a template with ``{prompt}`` -- as in training.
        think: "answer" (judge the text after a reasoning template's ``<think>...</think>`` block; the
            summary says so) or "whole" (judge everything generated) -- :func:`lora_kit.generation.answer_text`.
            Outputs that end inside the block (``max_new_tokens`` ran out) are counted per split and system in
            ``summary["decoding"]["think_unfinished"]`` and named in the summary sentence.
        source_names: names of in-memory ``heldout`` / ``control`` lists for the record.
        allow_incomplete_adapter: evaluate an adapter whose smoke run record (``smoke.json`` beside it)
            does not say "complete" (killed, failed, still running); refused by default, because such
            an adapter may be another run's leftover or unverified.
    Writes ``<run_dir>/eval/eval.json`` (atomic) and ``per_example.csv`` when ``run_dir`` is set.
    """
    if isinstance(base_model, Settings):
        given = {k: v for k, v in locals().items() if k in _DEFAULTS and k != "base_model" and not _same(v, _DEFAULTS[k])}
        return evaluate(**{**settings_kwargs(base_model), **given})
    _check_args(locals())
    if method not in ("lora", "qlora"):
        raise ValueError(f"method={method!r}: evaluate compares adapters on a base loaded for 'lora' (weights in "
                         "dtype) or 'qlora' (4-bit); for a full fine-tune pass its folder as base_model and adapters=None.")
    t0, c0 = time.perf_counter(), time.process_time()
    if run_dir is not None:
        check_output_dir(run_dir, create=False)
    identity = run_identity("evaluate", run_dir)
    adapter_paths = _adapters(adapters, run_dir)
    if adapters is None and not adapter_paths and run_dir is not None:
        _check_base_alone(Path(run_dir))
    adapter_runs = {name: _adapter_run(name, path, allow_incomplete_adapter) for name, path in adapter_paths.items()}
    systems = [C.BASE] + list(adapter_paths)

    fields = dict(prompt_field=prompt_field, response_field=response_field, data_format=data_format,
                  messages_field=messages_field)
    ho_rows = _rows(heldout, heldout_split, "heldout", n=n_heldout, **fields)
    ctl_rows = _rows(control, None, "control", n=n_control, **{**fields, "data_format": "auto"}) \
        if control is not None else []
    hygiene = _hygiene(heldout, heldout_split, train_examples, ho_rows, allow_overlap, fields)

    resolved = resolve_model(base_model)
    tokenizer = load_tokenizer(base_model, trust_remote_code=trust_remote_code, padding_side="left")
    model = load_model(base_model, method=method, dtype=dtype, trust_remote_code=trust_remote_code, device=device,
                       attn_implementation=attn_implementation)
    context = getattr(model.config, "max_position_embeddings", None)
    fmt = PromptFormat(tokenizer, resolve_prompt_format(prompt_format, tokenizer, is_conversational(ho_rows)))
    _check_lengths(fmt, ho_rows, "heldout", max_new_tokens, context)
    _check_lengths(fmt, ctl_rows, "control", max_new_tokens, context)
    adapter_paths = {name: local_adapter(path) for name, path in adapter_paths.items()}
    model, adapter_cfgs = load_adapters(model, adapter_paths, base_model, resolved, check_base_name)
    model.eval()

    splits = {"heldout": ho_rows, "control": ctl_rows}
    n_batches = sum(math.ceil(len(r) / batch_size) for r in splits.values()) * 2 * len(systems)
    bar = progress_bar(n_batches, "evaluate", enabled=progress, run_dir=run_dir, unit="batch")
    gen = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, do_sample=do_sample,
               temperature=temperature, seed=seed, think=think)
    timing: dict = {}
    per_example = pd.concat([_run_split(model, tokenizer, split, rows, systems, gen, bar, timing, fmt)
                             for split, rows in splits.items() if rows], ignore_index=True)
    if bar is not None:
        bar.close()

    stats = dict(confidence=confidence, n_resamples=n_resamples, seed=seed)
    summary = {
        "run": identity, "adapter_runs": adapter_runs,
        "base_model": base_model, "adapters": adapter_paths, "method": method, "dtype": dtype,
        "adapter_base_models": {k: v.get("base_model_name_or_path") for k, v in adapter_cfgs.items()},
        "decoding": {"do_sample": do_sample, "temperature": temperature if do_sample else None,
                     "max_new_tokens": max_new_tokens, "batch_size": batch_size, "padding": "left",
                     "stop": ["eos", "generation_config eos"] + (["newline"] if fmt.stop_at_newline else
                                                                    ["end of turn"]), "seed": seed,
                     "prompt_format": fmt.kind, "think": think,
                     "think_note": ("a <think>...</think> block is judged by the answer after it (think='answer')"
                                    if think == "answer" else "the whole output is judged, think block included")},
        "statistics": {"confidence": confidence, "n_resamples": n_resamples, "seed": seed,
                       "interval": "percentile bootstrap over examples (paired for differences)"},
        "heldout": {"source": (source_names or {}).get("heldout") or _describe(heldout), "split": heldout_split,
                    "n": len(ho_rows),
                    "hygiene": hygiene, "is_heldout": bool(hygiene.get("heldout", True))},
        "control": {"source": (source_names or {}).get("control") or _describe(control), "n": len(ctl_rows)},
    }
    summary.update(C.summarize(per_example, list(adapter_paths), summary["heldout"]["is_heldout"], **stats))
    summary["decoding"]["think_unfinished"] = timing.pop("think_unfinished", {})
    timing.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
    summary["timing"] = timing
    summary["versions"] = _versions()
    summary.pop("control_sentence")
    summary["summary_sentence"], control_sentence = summary_sentences(summary)
    summary["control"].update(summary_sentence=control_sentence, changed_fraction=summary.pop("control_changed_fraction"))
    result = EvalResult(summary=summary, per_example=per_example,
                        summary_sentence=" ".join(x for x in (summary["summary_sentence"], control_sentence) if x))
    if run_dir is not None:
        out = Path(run_dir) / EVAL_DIR
        result.paths = {"json": str(write_json_atomic(out / "eval.json", summary)),
                        "csv": str(write_text_atomic(out / "per_example.csv", per_example.to_csv(index=False)))}
    return result


def settings_kwargs(settings) -> dict:
    """:func:`evaluate` arguments from a :class:`lora_kit.Settings` (for notebooks and the CLI).

    Held-out rows: ``<run_dir>/data/heldout.jsonl`` when the smoke run wrote it (exactly the rows it
    held out), else :func:`lora_kit.data.run_data` (``heldout_dataset``, the embedded test split, or
    the ``heldout_fraction`` split of ``dataset`` by ``seed``). Overlap is checked against the rows
    the smoke run actually trained on (``<run_dir>/data/trained.jsonl``), else the training part.
    Control: ``control_dataset`` ("auto": the embedded model's own set for "tiny", the shipped
    generic set otherwise). Everything is loaded here, so the data field settings apply once.
    """
    s = settings
    held_file, trained_file = run_data_file(s.run_dir, "heldout"), run_data_file(s.run_dir, "trained")
    d = None if held_file and trained_file else run_data(s)
    heldout = load_examples(held_file) if held_file else d["heldout"]
    train = load_examples(trained_file) if trained_file else d["train"]
    ctl = control_source(s.control_dataset, s.model)
    control = load_examples(ctl, **({} if ctl.startswith(("tiny:", "generic:")) else field_settings(s, "control")))
    return dict(base_model=s.model, method=s.method, dtype=s.dtype, run_dir=s.run_dir,
                heldout=heldout, heldout_split=None, train_examples=train, control=control,
                source_names={"heldout": str(held_file) if held_file else d["heldout_source"], "control": ctl},
                n_heldout=s.eval_examples, n_control=s.control_examples, max_new_tokens=s.max_new_tokens,
                seed=s.seed, prompt_format=s.prompt_format, trust_remote_code=s.trust_remote_code,
                think=s.think,
                attn_implementation=s.attn_implementation)


def _same(a, b) -> bool:
    try:
        return bool(a is b or (type(a) is type(b) and a == b))
    except Exception:  # noqa: BLE001 - e.g. a DataFrame: never "the default"
        return False


def _check_args(args: dict) -> None:
    """Refuse bad arguments before anything loads, with the checks Settings uses for the same values."""
    for name in ("max_new_tokens", "batch_size", "n_resamples"):
        _check_int(name, args[name], 1, 1 << 24)
    for name in ("n_heldout", "n_control"):
        check_count(name, args[name])
    check_heldout_split(args["heldout_split"])
    if isinstance(args["heldout"], tuple) and len(args["heldout"]) == 2:  # (source, split)
        check_heldout_split(args["heldout"][1])
    flags = {name: parse_bool(name, args[name]) for name in ("do_sample", "allow_overlap", "check_base_name",
                                                              "trust_remote_code", "progress", "allow_incomplete_adapter")}
    t = args["temperature"]
    if flags["do_sample"] and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
        raise ValueError(f"temperature must be > 0 when do_sample=True, got {t!r}.")
    c = args["confidence"]
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < 1:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95 for a 95 % interval; got {c!r}.")


def _hygiene(heldout, heldout_split, train_examples, ho_rows, allow_overlap, fields) -> dict:
    if train_examples is None:
        if not isinstance(heldout, (str, os.PathLike)) or heldout_split is None:  # "train" is refused up front
            return {"checked": False, "reason": "no training data given (train_examples=None)", "heldout": True}
        try:
            train = _rows(heldout, "train", "train", **fields)
        except (ValueError, FileNotFoundError, KeyError) as e:
            return {"checked": False, "reason": f"no 'train' split of {os.fspath(heldout)!r}: {e}", "heldout": True}
    else:
        train = _rows(train_examples, None, "train", **fields)
    return {"checked": True, **check_heldout(overlap_report(train, ho_rows), allow_overlap)}


_DEFAULTS = {k: v.default for k, v in inspect.signature(evaluate).parameters.items()}




def summary_sentences(summary: dict) -> tuple[str, str | None]:
    """(held-out sentence, control sentence) of an evaluation, made from its summary (eval.json) alone: every
    metric of each adapter (:func:`lora_kit.evaluation.compare.joined_sentences`), then what outputs that ended
    inside a think block mean, and whether overlap with the training data went unchecked. :func:`evaluate`
    writes these; the run card makes them again from eval.json."""
    heldout, control = C.joined_sentences(summary, summary["heldout"]["is_heldout"])
    dec = summary.get("decoding") or {}
    if dec.get("think_unfinished"):
        heldout += _think_sentence(dec["think_unfinished"], {"heldout": summary["heldout"]["n"],
                                                             "control": summary["control"]["n"]},
                                   dec["max_new_tokens"], dec["think"])
    if summary.get("adapters") and not summary["heldout"]["hygiene"].get("checked", True):
        heldout += " Overlap with the training data was not checked (pass train_examples= to check it)."
    return heldout, control


def _think_sentence(cut: dict, n: dict, max_new_tokens: int, think: str) -> str:
    """What outputs that ended inside a <think> block mean for the comparison (``cut``: {"split:system": count})."""
    splits = {"heldout": "held-out", "control": "control"}
    parts = ", ".join(f"{k} of {n[split]} {system} outputs on the {splits[split]} set"
                      for (split, system), k in ((key.split(":", 1), k) for key, k in cut.items()))
    judged = "judged as empty answers" if think == "answer" else "judged with their unfinished think block"
    return (f" {parts} ended inside a <think> block (max_new_tokens={max_new_tokens} ran out "
            f"while thinking), {judged}; raise max_new_tokens to judge what the model answers.")


def _describe(source) -> str | None:
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, tuple):
        return f"{os.fspath(source[0])}:{source[1]}"
    return f"in-memory ({len(source)} rows)"


def _versions() -> dict:
    import peft
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
