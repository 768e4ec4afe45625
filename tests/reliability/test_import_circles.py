"""No import circle in ``src/mhe``, and importing a model loads neither generation nor a Triton kernel.

The circle check walks every module's module-level imports with ``ast`` (what runs when the module
is imported): top-level ``import`` and ``from ... import`` statements, those inside top-level
``if``/``try`` blocks included, ``if TYPE_CHECKING:`` blocks left out (they never run).
Function-local imports are left out on purpose: they run on first call, after every module
involved has finished importing, so they cannot deadlock or see a half-initialised module (the
kernel registry loads its plugins this way, and generation is imported by ``model.generate``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "mhe"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]):
    """The import statements that run when a module body runs (see the module docstring)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _type_checking(node):
            yield from _module_level_imports(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_level_imports(node.body + node.orelse + node.finalbody
                                             + [s for h in node.handlers for s in h.body])


def _targets(node, module: str, is_package: bool, known) -> set[str]:
    """The modules of ``src/mhe`` one import statement loads (a name imported from a package
    counts as its submodule where there is one)."""
    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return {t for t in map(owner, names) if t}


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {}
    for module, path in known.items():
        body = ast.parse(path.read_text()).body
        deps = set()
        for node in _module_level_imports(body):
            deps |= _targets(node, module, path.name == "__init__.py", known)
        graph[module] = deps - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_src_mhe():
    found = circles(import_graph())
    assert not found, f"import circles (module-level imports): {found}"


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ntry:\n    import y\n"
                     "except ImportError:\n    import z\ndef f():\n    import w\n")
    assert [a.name for n in _module_level_imports(tree.body) if isinstance(n, ast.Import) for a in n.names] == \
        ["y", "z"]


def test_importing_and_building_a_model_loads_no_generation_or_triton_kernel():
    """mhe's decode kernels (``flash_decode``, ``triton_decode``) and generation load on first use.
    (The ``triton`` package itself may load: torch's dynamo imports it where it is installed.)"""
    code = ("import sys\n"
            "from mhe.models import build_model, preset\n"
            "build_model(preset('gpt2-base').replace(n_layers=1, d_model=32, n_heads=4, d_ff=64, vocab_size=99))\n"
            "bad = sorted(m for m in sys.modules if m.startswith('mhe.generation') or m in (\n"
            "    'mhe.attention.triton_decode', 'mhe.attention.flash_decode'))\n"
            "print(','.join(bad))\n")
    env = {"PYTHONPATH": str(SRC), "MHE_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == ""
