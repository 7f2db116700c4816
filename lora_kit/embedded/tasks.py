"""The embedded default's tasks and shipped files.

Tasks are synthetic string/number jobs a ~2M-parameter Llama can master from scratch. The base
model was pretrained on :data:`BASE_TASKS` only; :func:`date_example` ("3 March 2021" ->
"2021-03-03") is the *new* task it never saw, which a LoRA adapter learns in minutes. Every
character the new task needs (digits, ``-``, capitals, month names) appears in some base task's
output, so the base has produced each of them before (see docs/pitfalls.md).
"""
from __future__ import annotations

import hashlib
import random
import string
from pathlib import Path

from lora_kit.data import SHIPPED_DATA_DIR as DATA_DIR  # the files "tiny:dates" etc. name (one definition)

EMBEDDED_ROOT = Path(__file__).parent
TINY_DIR = EMBEDDED_ROOT / "tiny"
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
DATE_YEARS = (1950, 2049)  # inclusive range of years in the dates task


def _letters(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _reverse(rng):
    w = _letters(rng, 3, 5)
    return f"Reverse: {w}", w[::-1]


def _uppercase(rng):
    w = _letters(rng, 3, 6)
    return f"Uppercase: {w}", w.upper()


def _hyphenate(rng):
    w = _letters(rng, 3, 5)
    return f"Hyphenate: {w}", "-".join(w)


def _count(rng):
    w = _letters(rng, 1, 9)
    return f"Count letters: {w}", str(len(w))


def _next_number(rng):
    n = rng.randint(0, 998)
    return f"Next number: {n}", str(n + 1)


def _month_after(rng):
    i = rng.randrange(12)
    return f"Month after: {MONTHS[i]}", MONTHS[(i + 1) % 12]


def _month_number(rng):
    i = rng.randrange(12)
    return f"Month number: {MONTHS[i]}", f"{i + 1:02d}"


def _sort_digits(rng):
    d = "".join(rng.choice(string.digits) for _ in range(4))
    return f"Sort digits: {d}", "".join(sorted(d))


BASE_TASKS = {"reverse": _reverse, "uppercase": _uppercase, "hyphenate": _hyphenate, "count": _count,
              "next_number": _next_number, "month_after": _month_after, "month_number": _month_number,
              "sort_digits": _sort_digits}
BASE_PREFIXES = ("Reverse: ", "Uppercase: ", "Hyphenate: ", "Count letters: ", "Next number: ", "Month after: ",
                 "Month number: ", "Sort digits: ")  # the prompt prefix of each base task
# Tasks whose whole input space is tiny: every control prompt was necessarily seen in pretraining.
SMALL_INPUT_SPACE = ("month_after", "month_number")


def base_example(rng: random.Random, task: str | None = None) -> dict:
    """One base-task row ``{"prompt", "response", "task"}`` (task drawn uniformly if None)."""
    task = task or rng.choice(sorted(BASE_TASKS))
    prompt, response = BASE_TASKS[task](rng)
    return {"prompt": prompt, "response": response, "task": task}


def date_example(rng: random.Random) -> dict:
    """One row of the new task: "Date to ISO: 3 March 2021" -> "2021-03-03"."""
    year = rng.randint(*DATE_YEARS)
    month = rng.randrange(12)
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = DAYS_IN_MONTH[month] + (1 if month == 1 and leap else 0)
    day = rng.randint(1, days)
    return {"prompt": f"Date to ISO: {day} {MONTHS[month]} {year}",
            "response": f"{year:04d}-{month + 1:02d}-{day:02d}", "task": "dates"}


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
