"""The documentation: generated files up to date, links that resolve, commands that CI runs or that say what they need.

Rules (docs/development.md): every shell command in a fenced ``bash`` / ``sh`` / ``shell`` / ``console`` block of
README.md or docs/*.md is a ``--help`` run (run here), or a command a named test or CI already runs (``COVERED``),
or carries ``# needs: gpu|hub|long`` -- on its line, or alone on the block's first line for the whole block. A
marked command becomes a test with that pytest marker, deselected by default (pyproject's ``addopts``) and run by
``-m long`` / ``-m gpu`` / ``-m hub``.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {ROOT / "docs" / "accuracy.md", ROOT / "docs" / "cli.md", ROOT / "docs" / "time-model.md"}
SHELL = {"bash", "sh", "shell", "console"}
KINDS = ("gpu", "hub", "long")
NEEDS = re.compile(r"#\s*needs:\s*([a-z ,|]+)$")

# Commands the suite or CI already runs, and where (a test "file::function", or a CI script).
COVERED = {
    r"bash scripts/setup\.sh && \.venv/bin/lora-kit run": "tests/test_pipeline.py::test_main_job_on_embedded_default",
    r"bash scripts/test\.sh( .*)?": ".ci/run",
    r"\.venv/bin/python docs/generate\.py( --check)?": "tests/test_docs.py::test_generated_docs_are_up_to_date",
}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    needs: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _blocks(path: Path):
    """(language, first line number, lines) of each fenced block."""
    lang, start, lines = None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^\s*```(\S*)\s*$", line)
        if m and lang is None:
            lang, start, lines = m.group(1).lower(), n + 1, []
        elif m:
            yield lang, start, lines
            lang = None
        elif lang is not None:
            lines.append(line)


def _needs(comment: str) -> tuple[str, ...]:
    m = NEEDS.search(comment.strip())
    if not m:
        return ()
    kinds = tuple(k for k in re.split(r"[ ,|]+", m.group(1)) if k)
    assert set(kinds) <= set(KINDS), f"unknown need in {comment!r}: use {'|'.join(KINDS)}"
    return kinds


def doc_commands() -> list[Command]:
    out = []
    for path in DOCS:
        for lang, start, lines in _blocks(path):
            if lang not in SHELL:
                continue
            first = next((ln for ln in lines if ln.strip()), "")
            block_needs = _needs(first) if first.strip().startswith("#") else ()
            n, pending, pending_line = start - 1, "", 0
            for line in lines:
                n += 1
                s = line.strip()
                if not pending and (not s or s.startswith("#")):
                    continue
                if not pending:
                    pending_line = n
                code, _, comment = s.partition(" #")
                if code.endswith("\\"):
                    pending += code[:-1].strip() + " "
                    continue
                text = (pending + code).strip()
                pending = ""
                out.append(Command(path.relative_to(ROOT).as_posix(), pending_line, text,
                                   tuple(sorted(set(block_needs) | set(_needs("#" + comment) if comment else ())))))
    return out


def _generator():
    return load_script("docs/generate.py", "lora_kit_docs_generate")


def test_generated_docs_are_up_to_date():
    """docs/accuracy.md, docs/cli.md, docs/time-model.md and README's headline table equal what docs/generate.py makes
    of the results files and the CLI parser now; run `.venv/bin/python docs/generate.py` and commit when this fails."""
    assert _generator().stale() == []


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    head = "\n".join(lines[:30])
    main, tests = "bash scripts/setup.sh && .venv/bin/lora-kit run", "bash scripts/test.sh"
    assert main in head and tests in head and head.index(main) < head.index(tests)


def _slugs(path: Path) -> set[str]:
    gen = _generator()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {gen.slug(m.group(1).strip()) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, flags=re.M)}


def test_relative_links_resolve():
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links inside code blocks are code
        targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img[^>]+src="([^"]+)"', text)
        for target in targets:
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert broken == []


def _covering(cmd: Command) -> str | None:
    for pattern, where in COVERED.items():
        if re.fullmatch(pattern, cmd.text):
            return where
    return None


def test_covered_commands_name_tests_that_exist():
    for where in COVERED.values():
        file, _, func = where.partition("::")
        assert (ROOT / file).is_file(), where
        assert not func or re.search(rf"^def {func}\(", (ROOT / file).read_text(), flags=re.M), where


def test_every_doc_command_runs_in_ci_or_says_what_it_needs():
    cmds = doc_commands()
    assert len(cmds) >= 5  # the parser found the blocks
    unaccounted = [str(c) for c in cmds if not c.needs and not _covering(c) and not c.text.endswith("--help")]
    assert unaccounted == [], "test these in CI (COVERED here) or mark them # needs: gpu|hub|long"


def test_help_commands_in_the_docs_run():
    for cmd in (c for c in doc_commands() if not c.needs and c.text.endswith("--help")):
        done = subprocess.run(["bash", "-c", cmd.text], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), f"{cmd}\n{done.stderr[-2000:]}"


def test_marked_commands_name_files_and_flags_that_exist():
    """What a marked command names is checked here, cheaply: the files it runs exist, a benchmark script knows
    its flags, and `-m module` can be found."""
    problems = []
    for cmd in (c for c in doc_commands() if c.needs):
        words = cmd.text.replace("&&", " ").split()
        for w in words:
            w = w.strip("'\"")
            if re.fullmatch(r"[\w./-]+\.(py|sh|ya?ml|jsonl)", w) and not w.startswith("/") and not (ROOT / w).exists():
                problems.append(f"{cmd}: {w} does not exist")
        scripts = [w for w in words if w.endswith(".py") and (ROOT / w).is_file()]
        for script in scripts:
            source = (ROOT / script).read_text()
            for flag in (w for w in words[words.index(script) + 1:] if w.startswith("--")):
                if f'"{flag}"' not in source:
                    problems.append(f"{cmd}: {script} has no {flag}")
        for i, w in enumerate(words[:-1]):
            if w == "-m" and words[i + 1].startswith("lora_kit"):
                if importlib.util.find_spec(words[i + 1]) is None:
                    problems.append(f"{cmd}: no module {words[i + 1]}")
    assert problems == []


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=[getattr(pytest.mark, k) for k in c.needs],
                                              id=f"{c.doc}:{c.line}")
                                 for c in doc_commands() if c.needs])
def test_marked_doc_command_runs(cmd):
    """Selected only with -m long / gpu / hub: runs the documented command as shown, from the repository root."""
    done = subprocess.run(["bash", "-c", cmd.text], cwd=ROOT)
    assert done.returncode == 0, str(cmd)


def _hand_written() -> list[tuple[Path, str]]:
    out = []
    for path in DOCS:
        if path in GENERATED:
            continue
        text = path.read_text()
        if path.name == "README.md":
            text = re.sub(r"<!-- generated: headline.*?<!-- end generated: headline -->", "", text, flags=re.S)
        out.append((path, text))
    return out


def test_no_hand_typed_measurements():
    """Percentages, memory sizes and durations in prose go stale with the next commit: the generator writes them
    (docs/accuracy.md). Hand-written pages say where a figure is, not what it was."""
    figure = re.compile(r"(?<![\w-])\d[\d,.]*\s?(%|GiB|GB|MiB|MB|KiB|ms|seconds|s per step|minutes|min)(?![\w])")
    found = [f"{p.name}: {m.group(0)}" for p, text in _hand_written() for m in figure.finditer(text)]
    assert found == []
