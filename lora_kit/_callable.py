"""Modules that are also their main function: ``lora_kit.estimate``, ``simulate``, ``evaluate``.

``lk.estimate(...)`` is the public API, and ``lora_kit/estimate.py`` is its module. Once the
submodule is imported, Python's import system binds the package attribute ``lora_kit.estimate``
to the *module*, so a later ``lk.estimate(...)`` would call a module. Making the module callable
(forwarding to the function of the same name) keeps both ``lk.estimate(...)`` and
``from lora_kit.estimate import estimate_arrays`` working, in any import order.
"""
from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rsplit(".", 1)[-1])(*args, **kwargs)


def make_callable(module_name: str) -> None:
    """Make ``sys.modules[module_name]`` call its function of the same name (signature kept for help())."""
    mod = sys.modules[module_name]
    mod.__class__ = _CallableModule
    mod.__wrapped__ = getattr(mod, module_name.rsplit(".", 1)[-1])
