"""``lora-kit``: run the notebook pipeline, estimate memory, check the stack.

    lora-kit run                          # everything on the embedded default, on CPU
    lora-kit run --params params/llama-3.1-8b-qlora-a100.yaml -p max_steps 20
    lora-kit estimate --model llama-3.1-8b --method qlora --seq-len 2048
    lora-kit check --json stack.json

Every setting flag comes from :class:`lora_kit.settings.Settings` (one definition); values are
validated before anything runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_kit.settings import Settings, field_help, field_names, load_settings

GiB = 1024 ** 3


def _add_setting_flags(p: argparse.ArgumentParser, names=None) -> None:
    helps = field_help()
    defaults = Settings().to_dict()
    g = p.add_argument_group("settings (defaults: the embedded tiny model on CPU)")
    for name in names or field_names():
        g.add_argument("--" + name.replace("_", "-"), dest="s_" + name, default=None, metavar="VALUE",
                       help=f"{helps.get(name, '')} [default: {defaults[name]!r}]")


def _settings_from_args(args, names=None) -> dict:
    return {n: getattr(args, "s_" + n) for n in (names or field_names())
            if getattr(args, "s_" + n, None) is not None}


def _parse_p(pairs) -> dict:
    return {k: v for k, v in (pairs or [])}


def cmd_run(args) -> int:
    from lora_kit.ui.pipeline import PipelineError, run_pipeline
    overrides = {**_settings_from_args(args), **_parse_p(args.p)}
    try:
        settings = load_settings(args.params, overrides)
    except ValueError as exc:
        print(f"lora-kit run: invalid settings: {exc}", file=sys.stderr)
        return 2
    name = args.name or Path(settings.run_dir).name or "default"
    out = Path(args.runs_dir) / name
    print(f"lora-kit run -> {out} (model={settings.model}, method={settings.method})")
    try:
        rec = run_pipeline(settings, out, notebooks=args.notebooks, only=args.only)
    except PipelineError as exc:
        print(f"lora-kit run: FAILED\n  {exc}", file=sys.stderr)
        return 1
    print(f"done in {rec['seconds']:.1f} s; results in {out}")
    return 0


ESTIMATE_FIELDS = tuple(Settings().estimate_kwargs()) + ("gpu", "margin")


def cmd_estimate(args) -> int:
    from lora_kit.memory.estimate import estimate
    try:
        s = load_settings(args.params, {**_settings_from_args(args, ESTIMATE_FIELDS), **_parse_p(args.p)})
        est = estimate(**s.estimate_kwargs())
    except ValueError as exc:
        print(f"lora-kit estimate: {exc}", file=sys.stderr)
        return 2
    fit = None
    try:
        from lora_kit.plan.gpus import get_gpu
        g = get_gpu(s.gpu)
        cap = int(g["memory_bytes"])
        fit = {"gpu": s.gpu, "capacity_bytes": cap, "fits": est.device_total_bytes <= cap * (1 - s.margin),
               "headroom_bytes": int(cap * (1 - s.margin) - est.device_total_bytes)}
    except Exception:  # the GPU catalog is optional for the estimate itself
        pass
    if args.json:
        print(json.dumps({"settings": s.estimate_kwargs(), "peak_allocated_bytes": est.peak_allocated_bytes,
                          "device_total_bytes": est.device_total_bytes, "breakdown": est.breakdown,
                          "fit": fit}, indent=2))
        return 0
    print(f"{s.model} · {s.method} · seq_len {s.seq_len} · batch {s.batch_size} · "
          f"{s.optimizer} · checkpointing {'on' if s.gradient_checkpointing else 'off'} · "
          f"{s.num_gpus} GPU(s) {s.sharding}")
    width = max(len(k) for k in est.breakdown) + 2
    for k, v in est.breakdown.items():
        print(f"  {k:<{width}}{v / GiB:10.3f} GiB")
    print(f"  {'peak allocated':<{width}}{est.peak_allocated_bytes / GiB:10.3f} GiB  (per GPU)")
    print(f"  {'device total':<{width}}{est.device_total_bytes / GiB:10.3f} GiB  (+ CUDA context, allocator reserve)")
    if fit:
        verdict = "fits" if fit["fits"] else "does NOT fit"
        print(f"  {s.gpu}: {verdict} with a {s.margin:.0%} margin "
              f"(headroom {fit['headroom_bytes'] / GiB:+.2f} GiB of {fit['capacity_bytes'] / GiB:.1f} GiB)")
    return 0


def cmd_check(args) -> int:
    from lora_kit.check import stack
    rep = stack.report()
    if args.json:
        from lora_kit.results import write_json_atomic
        write_json_atomic(args.json, rep)
    print(stack.format_table(rep))
    return 0


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
    _add_setting_flags(r)
    r.set_defaults(func=cmd_run)

    e = sub.add_parser("estimate", help="per-GPU memory estimate as a table")
    e.add_argument("--params", help="YAML file of settings")
    e.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override one setting")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_setting_flags(e, ESTIMATE_FIELDS)
    e.set_defaults(func=cmd_estimate)

    c = sub.add_parser("check", help="versions, hardware and real probes of the training stack")
    c.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    c.set_defaults(func=cmd_check)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
