"""A kind is a spec, not a string: no module of ``src/mhe`` outside ``attention/`` (and the
standalone ``hf/remote/``, which may not import mhe) compares an attention kind with a string
literal; it asks the kind's :class:`~mhe.attention.spec.AttentionSpec` instead."""

from __future__ import annotations

import ast
from pathlib import Path

from mhe.attention import KINDS

SRC = Path(__file__).resolve().parents[2] / "src" / "mhe"
EXEMPT = ("attention", "hf/remote")


def _is_kind(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in KINDS


def _names(node: ast.AST) -> str:
    """The identifiers an operand is made of (``cfg.train.schedule`` -> ``cfg train schedule``)."""
    return " ".join(n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                    if isinstance(n, (ast.Name, ast.Attribute)))


def kind_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a value with a kind literal: ``x == "gqa"``, ``x != "sha"``, ``x in ("mqa",
    ...)``, ``x.startswith("mhe-")``. A learning-rate ``schedule`` named ``linear`` is not a kind."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, (a, b) in zip(node.ops, zip(operands, operands[1:])):
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    hit = (_is_kind(a) and not _is_kind(b) and "schedule" not in _names(b)) or \
                          (_is_kind(b) and not _is_kind(a) and "schedule" not in _names(a))
                elif isinstance(op, (ast.In, ast.NotIn)):
                    hit = isinstance(b, (ast.Tuple, ast.List, ast.Set)) and any(_is_kind(e) for e in b.elts)
                else:
                    hit = False
                if hit:
                    lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and any(k.startswith(node.args[0].value) or node.args[0].value.startswith(k) for k in KINDS)
              and node.args[0].value):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_outside_attention_compares_a_kind_with_a_literal():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(EXEMPT):
            continue
        found += [f"{rel}:{line}" for line in kind_comparisons(ast.parse(path.read_text()))]
    assert not found, "kind literals compared (ask the kind's AttentionSpec): " + ", ".join(found)


def test_the_check_finds_each_form_it_forbids():
    """The check itself: each forbidden form is found, a schedule named linear and a lookup are not."""
    src = '''
if kind == "gqa": pass
if "sha" != cfg.attention: pass
if kind in ("fnet", "linear"): pass
if kind.startswith("mhe-"): pass
if cfg.train.schedule == "linear": pass
if "mha" in ref: pass
if spec.psi == "mul": pass
'''
    assert kind_comparisons(ast.parse(src)) == [2, 3, 4, 5]


def test_the_remote_code_keeps_one_kind_table_that_agrees_with_the_specs():
    """``hf/remote/`` (which may not import mhe) holds one table of kinds, ``configuration_mhe.KINDS``;
    its name lists (``layers_mhe.MHE_KINDS``, ``MIXING_KINDS``) are read from it, and it names the
    kinds of mhe's specs with the same groups."""
    from mhe.attention.spec import SPECS
    from mhe.hf.remote import configuration_mhe, layers_mhe

    table = configuration_mhe.KINDS
    assert tuple(table) == tuple(SPECS)
    assert layers_mhe.MHE_KINDS == tuple(k for k, s in SPECS.items() if s.is_mhe)
    assert layers_mhe.MIXING_KINDS == tuple(k for k, s in SPECS.items() if s.mixes)
