"""carpool's imports point downward only, and no module imports itself back in a circle.

The imports are read from the source with ``ast`` (nothing is imported, so no side
effects), the ones inside functions included: a lazy import is an arrow too.  The layer
order is ``LAYERS`` below, and only there (docs/ARCHITECTURE.md shows it to people).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "carpool"

# Bottom to top.  A module may import from its own package and from the layers below its
# own; packages sharing a layer do not import each other.
LAYERS: list[set[str]] = [
    {"embed"},  # sentence embeddings: below the engine, whose offline LLM.embed serves them
    {"engine"},
    {"openai"},
    {"client"},
    {"cache"},
    {"journal"},  # a job's output file as its journal: the batch jobs and the server's Batch API write it
    {"jobs"},
    {""},  # the package root, carpool/__init__.py: carpool.run_batch is the jobs API
    {"server"},
    {"bench", "tune"},
    {"distributed"},
    {"commands"},
    {"cli"},  # carpool/cli.py: the lazy dispatcher over commands/ (by module name)
]
# Beside the layers: may import any of them, and none of them imports it.
BESIDE = {"testing"}
# Leaf modules: import nothing of carpool but other leaves, so every module may import them.
LEAVES = {"paths", "report", "compat", "extras", "durations", "redact", "errors"}
# Cycles known today and who removes them (the test fails once one is gone: delete it here).
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The carpool module an imported name lives in (``carpool.jobs.input.tasks.Task`` -> its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:``: read by type checkers, never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(n) for n in ast.walk(node))
    return out


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported carpool module, line, whether only for type checking) for every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    typing_only = _type_checking_nodes(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package ``level - 1`` up
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.split(".")[0] == "carpool" else None
            if target is not None and target != module:
                found.append((target, node.lineno, id(node) in typing_only))
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _package(module: str) -> str:
    """``carpool.jobs.input.tasks`` -> ``jobs``; ``carpool.paths`` -> ``paths``; ``carpool`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(package: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) if package in names), None)


def test_every_package_has_a_place():
    packages = {_package(m) for m in MODULES}
    placed = set().union(*LAYERS, BESIDE, LEAVES)
    assert packages <= placed, f"add {sorted(packages - placed)} to LAYERS (or BESIDE / LEAVES) in this file"


def _upward_arrows() -> list[str]:
    bad = []
    for module, imports in GRAPH.items():
        src = _package(module)
        for target, line, _ in imports:
            dst = _package(target)
            if dst == src or dst in LEAVES:
                continue
            where = f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}"
            if src in LEAVES:
                bad.append(f"{where}: {src} is a leaf module and imports nothing of carpool")
            elif dst in BESIDE:
                bad.append(f"{where}: {dst} is beside the layers (for tests and benchmarks), not below them")
            elif src in BESIDE:
                continue
            elif (_layer(dst) or 0) >= (_layer(src) or 0):
                bad.append(f"{where}: {dst} is not below {src} (LAYERS in tests/test_layering.py)")
    return bad


def test_imports_point_downward():
    assert _upward_arrows() == []


def _cycles() -> list[set[str]]:
    """Strongly connected components (Tarjan) of the imports that run."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, typing_only in GRAPH[v]:
            if typing_only:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    cycles = _cycles()
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert new == [], "import cycles (a module reaches itself through these): " + "; ".join(map(str, new))
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert gone == [], f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


# Class names two modules still share, and who removes them (the test fails once one is
# gone: delete it here).
KNOWN_SHARED_CLASS_NAMES: dict[str, str] = {}


def _class_names() -> dict[str, list[str]]:
    """Every class defined in carpool (at any depth), by name: the modules defining it."""
    found: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def test_no_two_classes_share_a_name():
    # A reader who meets a class name in a traceback or a docstring finds one class by it.
    shared = {name: sorted(where) for name, where in _class_names().items() if len(where) > 1}
    new = {name: where for name, where in shared.items() if name not in KNOWN_SHARED_CLASS_NAMES}
    assert new == {}, f"classes of the same name in several modules: {new}"
    gone = sorted(set(KNOWN_SHARED_CLASS_NAMES) - set(shared))
    assert gone == [], f"these names are no longer shared: remove them from KNOWN_SHARED_CLASS_NAMES: {gone}"


@pytest.mark.parametrize("source, expected", [
    ("import carpool.jobs.input.tasks", ["carpool.jobs.input.tasks"]),
    ("from carpool.jobs.input.tasks import Task", ["carpool.jobs.input.tasks"]),
    ("from carpool import cache", ["carpool.cache"]),
    ("def f():\n    from carpool.engine import EngineConfig", ["carpool.engine"]),
    ("from .tasks import Task", ["carpool.jobs.input.tasks"]),
])
def test_the_walk_sees_every_form_of_import(tmp_path, monkeypatch, source, expected):
    # The checks above are only as good as this walk: each form of import must be found.
    module = "carpool.jobs.input._probe"
    path = tmp_path / "_probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, module, path)
    assert [t for t, _, _ in _imports(module)] == expected


def test_a_cycle_and_an_upward_arrow_are_caught(monkeypatch):
    def add(module: str, target: str) -> None:
        monkeypatch.setitem(GRAPH, module, [*GRAPH[module], (target, 1, False)])

    add("carpool.engine.config", "carpool.jobs.input.tasks")
    assert any("carpool/engine/config.py:1 imports carpool.jobs.input.tasks" in b for b in _upward_arrows())
    add("carpool.jobs.input.tasks", "carpool.jobs.input.readers")  # readers imports tasks: now a circle
    assert {"carpool.jobs.input.tasks", "carpool.jobs.input.readers"} in _cycles()


def test_importing_every_module_changes_no_environment_variable():
    """Library code sets nothing process-wide at import: no OMP_WAIT_POLICY, no HF
    offline mode.  The command line and the scripts call ``configure_process()`` themselves."""
    import subprocess
    import sys

    skip = ("carpool.testing", "carpool.distributed", "carpool.cli")  # Ray / entry point
    names = sorted(m for m in MODULES if not m.startswith(skip))
    code = (
        "import importlib, os, sys\n"
        "before = dict(os.environ)\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}\n"
        "print(sorted(changed))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("OMP_WAIT_POLICY", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing carpool changed {out.stdout.strip()}"
