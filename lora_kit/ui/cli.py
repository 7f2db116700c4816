"""``lora-kit``: run the notebook pipeline, estimate memory, check the stack.

    lora-kit run                          # everything on the embedded default, on CPU
    lora-kit run --params params/llama-3.1-8b-qlora-a100.yaml -p max_steps 20
    lora-kit estimate --model llama-3.1-8b --method qlora --seq-len 2048
    lora-kit estimate --from-config sft.yaml --gpu L4
    lora-kit check --json stack.json

Every setting flag comes from :class:`lora_kit.settings.Settings` (one definition); values are
validated before anything runs.
"""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
import textwrap
import time
from pathlib import Path

from lora_kit.memory.estimate import estimate
from lora_kit.memory.specs import allow_model_code, model_is_local, model_spec
from lora_kit.noise import quiet
from lora_kit.plan.gpus import compute_capability, get_gpu, gpu_problems
from lora_kit.plan.planner import (expandable_fit, expandable_sentence, fit_verdict, math_kernel_fit,
                                   math_kernel_sentence, plan_note)
from lora_kit.results import check_run_name, signal_name
from lora_kit.settings import (LORA_FIELDS, PLANNING, STEP_FIELDS, as_step, check_names, coerce_value, default_of,
                               field_help, field_names, load_settings, parse_bool, read_params)


GiB = 1024 ** 3


def _add_setting_flags(p: argparse.ArgumentParser, names=None, defaults=None, title=None) -> None:
    helps = field_help()
    defaults = {k: default_of(k) for k in field_names()} if defaults is None else defaults
    g = p.add_argument_group(title or "settings (defaults: the embedded tiny model on CPU)")
    for name in names or field_names():
        shown = f" [default: {defaults[name]!r}]" if name in defaults else ""
        planning = getattr(PLANNING, name, defaults.get(name))
        if name in defaults and name in STEP_FIELDS and planning != defaults[name]:  # the text's "Default" is the
            # planning default (a real model on a GPU); this command's is the embedded model's on a CPU
            shown = f" [default here: {defaults[name]!r}, for the embedded model on a CPU; planning: {planning!r}]"
        g.add_argument("--" + name.replace("_", "-"), dest="s_" + name, default=None, metavar="VALUE",
                       help=f"{helps.get(name, '')}{shown}".replace("%", "%%"))  # argparse formats %


def _settings_from_args(args, names=None) -> dict:
    return {n: getattr(args, "s_" + n) for n in (names or field_names())
            if getattr(args, "s_" + n, None) is not None}


def _parse_p(pairs) -> dict:
    return {k: v for k, v in (pairs or [])}


def cmd_run(args) -> int:
    from lora_kit.ui.pipeline import PipelineError, run_pipeline
    t0 = time.monotonic()
    if hasattr(sys.stdout, "reconfigure"):  # progress lines appear as they come, also in a pipe or a CI log
        sys.stdout.reconfigure(line_buffering=True)
    overrides = {**_settings_from_args(args), **_parse_p(args.p)}
    try:
        settings = load_settings(args.params, overrides)
        if settings.trust_remote_code:
            allow_model_code(settings.model)
        for g in dict.fromkeys([settings.gpu, *(settings.gpus or [])]):  # notebook 01 would refuse it after 00
            if isinstance(g, str):
                get_gpu(g)
        problems = gpu_problems(settings.gpu, settings.step) if isinstance(settings.gpu, str) else []
        if problems:  # the step this run trains, on the GPU it plans for: bf16 / flash-attn 2 on a pre-Ampere card
            raise ValueError(f"gpu={settings.gpu!r}, the GPU this run plans for, cannot run its step: "
                             f"{'; '.join(problems)}; change it with -p KEY VALUE or in the params file. Nothing ran")
        from lora_kit.ui.pipeline import select_notebooks
        chosen = select_notebooks(args.only)
        if model_is_local(settings.model):  # a missing folder or a malformed config.json: said before anything runs
            model_spec(settings.model)
            if {"03_smoke_run.ipynb", "04_evaluate.ipynb"} & set(chosen):  # no safetensors: said before 00 starts
                from lora_kit.loading import check_weights, resolve_model
                check_weights(resolve_model(settings.model))
        elif {"03_smoke_run.ipynb", "04_evaluate.ipynb"} & set(chosen):  # a hub id or catalog name: its weights
            from lora_kit.loading import resolve_model  # must be reachable (or cached) before 00 starts
            resolve_model(settings.model)
        if "03_smoke_run.ipynb" in chosen:  # what the smoke run cannot run, before 00 starts
            from lora_kit.run.smoke import check_runnable
            check_runnable(settings, world=1)
    except ValueError as exc:
        print(f"lora-kit run: invalid settings: {exc}", file=sys.stderr)
        return 2
    if {"00_stack_check.ipynb", "03_smoke_run.ipynb"} & set(chosen) and not args.resume:
        # what 00 would refuse, in seconds: every data file read and formatted (00 also tokenises each row with the
        # model's tokenizer); under long_examples="error", the training rows 03 would refuse (tokenised once)
        from lora_kit.data_check import check_data, check_long_examples
        try:
            if "00_stack_check.ipynb" in chosen:
                check_data(settings, load_tokenizer=False)
            if "03_smoke_run.ipynb" in chosen:
                check_long_examples(settings)
        except (ValueError, OSError) as exc:
            print(f"lora-kit run: data: {exc}", file=sys.stderr)
            return 2
    out = None
    try:
        name = check_run_name(args.name if args.name is not None else Path(settings.run_dir).name or "default")
        out = Path(args.runs_dir) / name
        print(f"lora-kit run -> {out} (model={settings.model}, method={settings.method})")
        rec = run_pipeline(settings, out, notebooks=args.notebooks, only=args.only,
                           overwrite=args.overwrite, resume=args.resume)
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: recorded in pipeline.json, card built; one line here
        where = f"; results so far and the run card are in {out}" if out is not None and out.exists() else ""
        # the interrupted kernel client leaves asyncio tasks that would log at exit
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        print(f"lora-kit run: interrupted ({signal_name(exc)}){where}", file=sys.stderr)
        return 143 if signal_name(exc) == "SIGTERM" else 130
    except PipelineError as exc:
        print(f"lora-kit run: FAILED\n  {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad input: nothing ran
        print(f"lora-kit run: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions: the message names the file
        print(f"lora-kit run: {exc}", file=sys.stderr)
        return 1
    if rec.get("not_written"):  # the run ended but its record could not be saved: say so, fail
        print(f"lora-kit run: {rec['status']}, but the disk is full: "
              + "; ".join(rec["not_written"][-2:]), file=sys.stderr)
        return 1
    took = f"done in {time.monotonic() - t0:.1f} s (notebooks {rec['seconds']:.1f} s, then the run card)"
    if rec["status"] != "complete":
        print(f"{took}: {rec['status']} (not run: {', '.join(rec['not_run'])}); results in {out}")
    else:
        print(f"{took}; results in {out}")
    return 0


ESTIMATE_FIELDS = ("model", *STEP_FIELDS, "gpu", "margin", "trust_remote_code")


def _resolved(name: str, plan: dict) -> str:
    """What an "auto" value resolves to for this step (``qlora_prepare``), printed after it."""
    if name == "qlora_prepare" and plan.get(name) == "auto":
        return f" -> {as_step(plan).qlora_recipe}"
    return ""


def estimate_plan(given: dict) -> tuple[dict, list[str]]:
    """The plan ``lora-kit estimate`` sizes: ``given`` (params file + flags) over the planning defaults
    (``settings.PLANNING``: bf16, 2048 tokens, micro-batch 1, checkpointing on), the target GPU and margin from
    Settings. Returns (plan: ``model``, the Step as ``step``, its fields, ``gpu``, ``margin``; names of the values
    that were assumed)."""
    check_names(given, ESTIMATE_FIELDS, "lora-kit estimate setting")
    if "model" not in given:
        raise ValueError("--model is required: a catalog name (e.g. llama-3.1-8b), a local model folder or a hub id.")
    given = {k: coerce_value(k, v) for k, v in given.items()}
    if parse_bool("trust_remote_code", given.get("trust_remote_code", False)):
        allow_model_code(given["model"])
    step = PLANNING.replace(**{k: v for k, v in given.items() if k in STEP_FIELDS})
    plan = {"model": given["model"], **step.to_dict(), "gpu": given.get("gpu", default_of("gpu")),
            "margin": float(given.get("margin", default_of("margin"))), "step": step}
    return plan, [k for k in ESTIMATE_FIELDS if k not in given]


PART_NAMES = {"weights": "weights", "quant_constants": "4-bit quantization constants", "adapters": "LoRA adapters",
              "gradients": "gradients", "optimizer_states": "optimizer states"}
# the breakdown's "activations" is everything else live at the peak: what that is depends on the phase
REST_NAMES = {"forward": "activations saved for backward, logits",
              "backward": "activations + backward temporaries",
              "optimizer": "optimizer-step temporaries"}


def part_name(key: str, phase: str) -> str:
    """What a breakdown part is, in words, at the phase of the peak."""
    return REST_NAMES.get(phase, "activations and temporaries") if key == "activations" else PART_NAMES.get(key, key)


def plan_from_config(path, given: dict) -> tuple[dict, list[str], object]:
    """``lora-kit estimate --from-config``: the step the config's tool runs (``settings_from_config``), with
    ``given`` (params file + flags) winning. Returns (plan, assumed names, the config report)."""
    from lora_kit.plan.config_import import settings_from_config
    check_names(given, ESTIMATE_FIELDS, "lora-kit estimate setting")
    over = {k: coerce_value(k, v) for k, v in given.items() if k in STEP_FIELDS}
    step, report = settings_from_config(path, model=given.get("model"), **over)
    plan, _ = estimate_plan({**{k: v for k, v in given.items() if k in ("gpu", "margin")}, "model": report.model,
                             **step.to_dict()})
    assumed = [k for k in ESTIMATE_FIELDS if k in report.defaults and k not in given
               or k in ("gpu", "margin") and k not in given]
    return plan, assumed, report


def params_for_estimate(path) -> tuple[dict, list[str], str]:
    """A params file as ``lora-kit estimate`` reads it: (the values it plans with -- model, step fields, gpu,
    margin --, the run's other settings it ignores, its ``from_config``). A run's own params file, and the
    ``settings.json`` ``lora-kit run`` writes (with the run's identity, ``run``, left aside), hold dataset,
    evaluation and output settings too: those are ignored (and listed); a name that is no setting at all is
    refused, with "did you mean"."""
    params = read_params(path)  # without the run identity lora_kit.results stamps on what a run writes
    check_names(params, field_names())
    ignored = [k for k in params if k not in ESTIMATE_FIELDS and k != "from_config"]
    return {k: v for k, v in params.items() if k in ESTIMATE_FIELDS}, ignored, params.get("from_config") or ""


def cmd_estimate(args) -> int:
    report = None
    try:
        params, ignored, config = params_for_estimate(args.params) if args.params else ({}, [], "")
        from_config = args.from_config or config
        if config and not args.from_config:  # as notebooks 01/02: the config's model and step replace the file's
            ignored += [k for k in params if k in ("model", *STEP_FIELDS)]
            params = {k: v for k, v in params.items() if k not in ("model", *STEP_FIELDS)}
        given = {**params, **_settings_from_args(args, ESTIMATE_FIELDS), **_parse_p(args.p)}
        if from_config:
            plan, assumed, report = plan_from_config(from_config, given)
        else:
            plan, assumed = estimate_plan(given)
        est = estimate(plan["model"], plan["step"])
        fit = fit_verdict(est.device_total_bytes, plan["gpu"], plan["margin"])
        torch_reports = est.cuda_allocated_bytes(compute_capability(fit["gpu"]))
        expandable = expandable_fit(plan["model"], plan["step"], est, fit["gpu"], plan["margin"])
        math_fit = math_kernel_fit(plan["model"], plan["step"], est, fit["gpu"], plan["margin"])
        note = plan_note(plan["model"], plan["step"], fit["gpu"], est.peak_allocated_bytes)
        problems = gpu_problems(fit["gpu"], plan["step"])  # what the card cannot run of the step: beside the verdict
    except ValueError as exc:
        print(f"lora-kit estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"settings": est.settings, "assumed": assumed, "ignored_params": ignored, "gpu": plan["gpu"],
               "margin": plan["margin"],
               "peak_allocated_bytes": est.peak_allocated_bytes, "device_total_bytes": est.device_total_bytes,
               "allocator": "default", "device_total_expandable_bytes": expandable["device_total_bytes"],
               "fit_expandable": expandable, "fit_math_kernel": math_fit,
               "cuda_allocated_bytes": torch_reports, "breakdown": est.breakdown, "phase": est.phase, "memory_model": est.memory_model, "fit": fit,
               "note": note, "runs_on_gpu": not problems, "gpu_problems": problems}
        if report is not None:  # what the config set that the plan does not model, or that does not matter
            out.update({"model": plan["model"], "not_modelled": report.not_modelled, "ignored": report.ignored,
                        "from_config": report.to_dict()})
        print(json.dumps(out, indent=2))
        return 0
    if report is not None:
        print(report.text())
    print(f"lora-kit estimate: {plan['model']}, one training step, per GPU")
    if ignored:
        why = "run settings, and the model and step from_config replaces" if config and not args.from_config \
            else "run settings, no effect on the step's memory"
        print(f"  ignored from {args.params} ({why}): {', '.join(ignored)}")
    print("  values (* = assumed, not given; defaults for planning a real model on a GPU):")
    unused = (*LORA_FIELDS, "double_quant", "qlora_prepare") if plan["method"] == "full" else () \
        if plan["method"] == "qlora" else ("double_quant", "qlora_prepare")
    for k in ESTIMATE_FIELDS:
        if k in plan and k not in unused:
            print(f"    {'*' if k in assumed else ' '} {k:<24}{plan[k]!r}{_resolved(k, plan)}")
    names = {k: part_name(k, est.phase) for k in est.breakdown}
    width = max(len(n) for n in names.values()) + 2
    print(f"  parts at the peak ({est.phase} phase):")
    for k, v in est.breakdown.items():
        print(f"  {names[k]:<{width}}{v / GiB:10.3f} GiB")
    print(f"  {'peak allocated':<{width}}{est.peak_allocated_bytes / GiB:10.3f} GiB  (per GPU, in {est.phase})")
    print(f"  {'device total':<{width}}{est.device_total_bytes / GiB:10.3f} GiB  (the process on the GPU: peak + CUDA "
          "context + torch's reserve, default allocator + outside torch)")
    print(f"  {'  with expandable segments':<{width}}{expandable['device_total_bytes'] / GiB:10.3f} GiB  "
          "(expandable_segments:True, what lora-kit's GPU path sets; fits counts the default setting's)")
    math = " runs in the math kernel" in (note or "")  # the note says what the math kernel adds on top
    print(f"  {'torch will report':<{width}}{torch_reports / GiB:10.3f} GiB  "
          f"(max_memory_allocated on {fit['gpu']}: the peak + two cuBLAS workspaces"
          + ("; more where CUDA runs the attention in the math kernel, see the note)" if math else ")"))
    print(textwrap.fill(f"memory model: {est.memory_model}" + ("" if est.memory_model.startswith("fitted") else
                                                                "; `lora-kit fit` with the same flags fits it"),
                        width=110, initial_indent="  ", subsequent_indent="    "))
    verdict = "fits" if fit["fits"] else "does NOT fit"
    basis = "from the vendor's GB" if fit["capacity_basis"].startswith("fallback") else "CUDA-visible"  # judged on
    print(f"  {fit['gpu']}: {verdict} with a {plan['margin']:.0%} margin "
          f"(headroom {fit['headroom_bytes'] / GiB:+.2f} GiB of {fit['cuda_capacity_bytes'] / GiB:.1f} GiB {basis})")
    for p in problems:  # fits is memory only: what the card cannot run is said apart, one line each
        print(textwrap.fill(f"{fit['gpu']} CANNOT RUN this step as planned: {p}.", width=110, initial_indent="  ",
                            subsequent_indent="    "))
    for ex in (math_kernel_sentence(fit, math_fit), expandable_sentence({"fits": fit["fits"], "expandable": expandable})):
        if ex:
            print(textwrap.fill(ex, width=110, initial_indent="  ", subsequent_indent="    "))
    if note:
        print(textwrap.fill(f"note: {note}", width=110, initial_indent="  ", subsequent_indent="    "))
    return 0


def cmd_fit(args) -> int:
    """Fit ``simulate`` for the plan's model and step (the closed form ``estimate`` evaluates) and store it."""
    from lora_kit.memory import fits
    try:
        params, _, _ = params_for_estimate(args.params) if args.params else ({}, [], "")
        plan, _ = estimate_plan({**params, **_settings_from_args(args, ESTIMATE_FIELDS), **_parse_p(args.p)})
        step, config = plan["step"], model_spec(plan["model"]).config
        folder = Path(args.folder) if args.folder else None
        f, info = fits.make(config, step, folder=folder, show=None if args.quiet else f"fitting {plan['model']}")
        est = estimate(plan["model"], step)
    except ValueError as exc:
        print(f"lora-kit fit: {exc}", file=sys.stderr)
        return 2
    where = fits.stored_path(config, step, folder or fits.user_dir())
    print(f"lora-kit fit: {plan['model']} fitted in {info['seconds']} s ({f.size()} operators kept) -> {where}")
    print(f"  {step}")
    print(f"  estimate now: {est.peak_allocated_bytes / GiB:.3f} GiB peak allocated ({est.memory_model})")
    return 0


CHECK_FIELDS = ("method", "dtype", "autocast", "optimizer", "gradient_checkpointing", "attn_implementation", "gpu")


def cmd_check(args) -> int:
    """Probes, then the verdict for the planned settings; exit 1 when a probe the plan needs failed."""
    from lora_kit.check import stack
    try:
        s = load_settings(args.params, {**_settings_from_args(args, CHECK_FIELDS), **_parse_p(args.p)})
        if s.trust_remote_code:
            allow_model_code(s.model)
    except ValueError as exc:
        print(f"lora-kit check: invalid settings: {exc}", file=sys.stderr)
        return 2
    from lora_kit.data_check import check_data
    try:  # every file the run reads, loaded and formatted before any probe loads a model
        data = check_data(s)
    except ValueError as exc:
        print(f"lora-kit check: data: {exc}", file=sys.stderr)
        return 1
    print("\n".join(f"data: {line}" for line in data["lines"]))
    rep = stack.report(s)
    rep["data"] = data
    if args.json:
        from lora_kit.results import write_json_atomic
        write_json_atomic(args.json, rep)
    print(stack.format_table(rep))
    return stack.exit_code(rep)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-kit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run the notebook pipeline with papermill into runs/<name>/",
                       description="Run 00_stack_check … 04_evaluate headless into runs/<name>/ "
                                   "(executed notebooks, HTML, results JSON, run card).")
    r.add_argument("--params", help="YAML file of settings (see params/ for examples)")
    r.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override one setting")
    r.add_argument("--name", help="run name (folder under --runs-dir); default: the last part of run_dir")
    r.add_argument("--runs-dir", default="runs", help="parent folder of run folders [default: runs]")
    r.add_argument("--only", nargs="+", help="run only these notebooks (prefixes, e.g. 00 03)")
    r.add_argument("--notebooks", help="folder of the notebooks [default: the kit's notebooks/]")
    r.add_argument("--overwrite", action="store_true",
                   help="the run folder holds a run: move it aside (<name>.replaced-<id>) and start afresh")
    r.add_argument("--resume", action="store_true",
                   help="the run folder holds a run with the same settings: keep its notebooks that completed, "
                        "run the rest")
    _add_setting_flags(r)
    r.set_defaults(func=cmd_run)

    e = sub.add_parser("estimate", help="per-GPU memory estimate as a table")
    e.add_argument("--params", help="YAML file of settings, e.g. the run's own params file or the settings.json "
                                    "lora-kit run wrote: its model, step fields, gpu and margin are planned (its "
                                    "from_config too); its other settings are listed as ignored")
    e.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override one setting")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--from-config", metavar="PATH",
                   help="plan the step of your training config: TRL SFT YAML, axolotl YAML, LLaMA-Factory YAML, "
                        "torchtune recipe YAML or TrainingArguments JSON (detected by content); flags win over it; "
                        "what it sets that the plan does not model is listed")
    _add_setting_flags(e, ESTIMATE_FIELDS, {**PLANNING.to_dict(), "gpu": default_of("gpu"),
                                            "margin": default_of("margin")},
                       "plan (defaults: planning a real model on a GPU; every assumed value is printed)")
    e.set_defaults(func=cmd_estimate)

    f = sub.add_parser("fit", help="fit the memory model (simulate in closed form) for a model and step, and keep it",
                       description="Run simulate on shallow, short steps of the model's architecture, fit the "
                                   "closed form estimate evaluates for the step's settings (any length, micro-batch, "
                                   "rank and depth), and store it in the fits cache ($LORA_KIT_FITS, default "
                                   "~/.cache/lora_kit/fits): after installing other library versions, or for a "
                                   "step no stored fit covers. Takes the same settings as lora-kit estimate.")
    f.add_argument("--params", help="YAML file of settings (as for lora-kit estimate)")
    f.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override one setting")
    f.add_argument("--folder", help="store the fit here instead of the fits cache")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_setting_flags(f, ESTIMATE_FIELDS, {**PLANNING.to_dict(), "gpu": default_of("gpu"),
                                            "margin": default_of("margin")}, "step to fit (defaults: planning)")
    f.set_defaults(func=cmd_fit)

    c = sub.add_parser("check", help="versions, hardware and real probes of the training stack; exit 1 when a "
                                     "probe the planned settings need failed")
    c.add_argument("--params", help="YAML file of settings: the plan the verdict is for")
    c.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override one setting")
    c.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    _add_setting_flags(c, CHECK_FIELDS)
    c.set_defaults(func=cmd_check)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # one line: what was not understood and the closest flag the command has (argparse: its usage)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        hints = [f"did you mean {close[0]} for {x}?" for x in extra if x.startswith("-")
                 for close in [difflib.get_close_matches(x.split("=")[0], flags, 1)] if close]
        print(f"lora-kit {args.command}: unrecognized arguments: {' '.join(extra)}" + (f"; {' '.join(hints)}" if hints
              else "") + f" (`lora-kit {args.command} --help` lists them)", file=sys.stderr)
        return 2
    quiet()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
