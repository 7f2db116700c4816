"""Known-harmless messages of the libraries the kit drives, silenced by their exact text, nothing else.

Each entry says why it is harmless here. :func:`quiet` installs the filters (idempotent); the notebooks'
``setup`` call, the CLI and the smoke run's ``torchrun`` entry call it, so a person reads only what
matters. The Python API (``lora_kit.simulate``) runs under :func:`quieted`, the same filters for the duration of
the call only: importing or calling the kit never changes the caller's own warning filters. Anything not listed
still shows.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings

# (category, start of the message as a regex, why it is harmless)
WARNINGS = (
    (FutureWarning, r"`(gradient_checkpointing_enable|is_gradient_checkpointing)` is deprecated",
     "transformers 5 renamed them activation_checkpointing*; peft still calls the old names, which forward to "
     "the new ones"),
    (UserWarning, r"Paged optimizers are not supported on CPU",
     "bitsandbytes falls back to the same optimizer without paging; paging only matters on CUDA, and the kit "
     "plans paged optimizers' memory for the GPU"),
    (UserWarning, r"Could not find a config file in ",
     "peft looks for the base's config.json under the adapter's recorded base name (a portable name such as "
     "'tiny', never a local path) to tell whether the vocabulary was resized; offline it cannot, and assumes "
     "not, which holds for the kit's adapters (no embedding is resized)"),
)
# logger name -> (start of the message, why it is harmless)
LOGS = {
    "transformers.utils.generic": ("`use_cache=True` is incompatible with gradient checkpointing",
                                   "training never uses the generation cache; transformers turns it off itself"),
    "transformers.modeling_layers": ("Caching is incompatible with gradient checkpointing",
                                     "the same message from the checkpointed layers"),
    "transformers.modeling_flash_attention_utils": ("Casting fp32 inputs back to",
                                                    "flash_attention_2 with QLoRA's fp32 q/k/v: the kit counts the "
                                                    "cast copies and its figures' note says so"),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",
                                      "AVX512-BF16 CPUs only: the optional hub kernel is absent (offline, or the "
                                      "`kernels` package is not installed) and bitsandbytes uses its own CPU kernel"),
}


class _DropKnown(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def _ignore_known_warnings() -> None:
    for category, pattern, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def quiet() -> None:
    """Install the filters for :data:`WARNINGS` and :data:`LOGS` (once per process)."""
    _ignore_known_warnings()
    for name, (start, _why) in LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.start == start for f in logger.filters):
            logger.addFilter(_DropKnown(start))


@contextlib.contextmanager
def quieted():
    """The filters of :func:`quiet` inside the block only; the caller's warning filters and loggers come back as
    they were."""
    added = []
    with warnings.catch_warnings():
        _ignore_known_warnings()
        for name, (start, _why) in LOGS.items():
            logger, f = logging.getLogger(name), _DropKnown(start)
            logger.addFilter(f)
            added.append((logger, f))
        try:
            yield
        finally:
            for logger, f in added:
                logger.removeFilter(f)


def quieted_call(fn):
    """``fn`` run under :func:`quieted` (a decorator for the public API)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with quieted():
            return fn(*args, **kwargs)
    return wrapper


def is_known(message: str) -> bool:
    """True when ``message`` is one of the silenced ones (tests use it to look for what is left)."""
    return any(re.match(p, message) for _c, p, _w in WARNINGS) or any(
        message.startswith(start) for start, _w in LOGS.values())
