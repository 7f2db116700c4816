"""The package's shape: imports point down the journey, no cycles, one public API.

Layers, lowest first (a module may import its own layer and the ones below it):
ground floor (settings, results, loading, data, prompting, training, generation) -> memory ->
plan / check -> run -> evaluation -> embedded -> ui. A layer is the first name under lora_kit (the
ground floor: modules directly in it); there are no special cases. The files the package ships
(the embedded model, the named datasets such as "tiny:dates") are package data, read as files by
the ground floor (``loading``, ``data``), not imported from ``embedded``.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import lora_kit

PACKAGE = Path(lora_kit.__file__).parent
LAYERS = {"": 0, "memory": 1, "plan": 2, "check": 2, "run": 3, "evaluation": 4, "embedded": 5, "ui": 6}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join(["lora_kit", *parts])] = path
    return out


def _layer(module: str) -> int:
    name = module.removeprefix("lora_kit").lstrip(".")
    sub = name.split(".")[0] if "." in name else ""
    return LAYERS[sub]


def _imports(path: Path, modules: dict) -> set[str]:
    """Every lora_kit module ``path`` imports, at top level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("lora_kit"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; use absolute lora_kit.* imports")
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lora_kit")}
    return out - {"lora_kit"}


def test_imports_point_down_only():
    modules = _modules()
    wrong = []
    for mod, path in modules.items():
        if mod == "lora_kit":
            continue
        for dep in _imports(path, modules):
            assert dep in modules, f"{mod} imports {dep}, which does not exist"
            if _layer(dep) > _layer(mod):
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items() if m != "lora_kit"}
    state: dict[str, int] = {}

    def visit(m, stack):
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_subpackage_inits_are_empty():
    for init in PACKAGE.glob("*/__init__.py"):
        assert init.read_text().strip() == "", f"{init} should stay empty (the public API lives in lora_kit/__init__.py)"


def test_no_module_shadows_a_public_function():
    """``lk.estimate`` / ``lk.simulate`` / ``lk.evaluate`` stay functions whatever was imported before."""
    for info in pkgutil.walk_packages(lora_kit.__path__, "lora_kit."):
        importlib.import_module(info.name)
    for name in lora_kit._LAZY:
        obj = getattr(lora_kit, name)
        assert inspect.isfunction(obj) or inspect.isclass(obj), (name, obj)
    for name, module in lora_kit._MODULES.items():
        assert inspect.ismodule(getattr(lora_kit, name)) and getattr(lora_kit, name).__name__ == module
    assert set(lora_kit.__all__) >= set(lora_kit._LAZY) | {"stack", "DEFAULT_MODEL"}


def test_planning_imports_stay_torch_free():
    """estimate / sweep / the CLI's estimate answer in a fraction of a second: torch is not imported."""
    import subprocess
    import sys
    code = ("import sys, lora_kit.memory.estimate, lora_kit.plan.planner, lora_kit.plan.figures; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
