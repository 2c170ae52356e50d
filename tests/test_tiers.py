"""The test tiers stay honest: every test that spawns gloo ranks (``run_distributed``,
also through a helper or fixture of its module) is marked ``multirank``, and every test
that runs ``python -m mct`` in a subprocess is marked ``cli``, so ``make test-fast``
(``-m "not multirank and not cli and not slow"``) never starts them."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SPAWNS = {"run_distributed"}
SUBPROCESS = {"run", "Popen", "check_output", "check_call", "call"}


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _direct(fn: ast.FunctionDef) -> tuple[set[str], set[str]]:
    """(what ``fn`` starts itself: 'multirank' / 'cli', the names it refers to)."""
    kinds, names = set(), {a.arg for a in fn.args.args}
    cli = any(isinstance(c, ast.Constant) and c.value == "mct" for c in ast.walk(fn))
    for n in ast.walk(fn):
        if isinstance(n, ast.Name):
            names.add(n.id)
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in SPAWNS:
            kinds.add("multirank")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "subprocess" \
                and name in SUBPROCESS and cli:
            kinds.add("cli")
        if name:
            names.add(name)
    return kinds, names


def _reach(graph: dict[str, tuple[set[str], set[str]]], name: str, seen: frozenset = frozenset()) -> set[str]:
    if name not in graph or name in seen:
        return set()
    kinds, names = graph[name]
    out = set(kinds)
    for n in names:
        out |= _reach(graph, n, seen | {name})
    return out


def _marks(fn: ast.FunctionDef, tree: ast.Module) -> set[str]:
    marks = set()
    for d in fn.decorator_list:
        text = ast.unparse(d)
        marks |= {m for m in ("multirank", "cli") if f"mark.{m}" in text}
    for n in tree.body:  # pytestmark = [...] for the whole module
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets):
            marks |= {m for m in ("multirank", "cli") if f"mark.{m}" in ast.unparse(n.value)}
    return marks


def unmarked() -> list[str]:
    """'file::test needs KIND' for each test that starts what its marks do not say."""
    shared: dict[str, tuple[set[str], set[str]]] = {}
    for helper in ("helpers.py", "distributed.py"):
        for name, fn in _functions(ast.parse((TESTS / helper).read_text())).items():
            shared[name] = _direct(fn)
    missing = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        funcs = _functions(tree)
        graph = {**shared, **{n: _direct(f) for n, f in funcs.items()}}
        for name, fn in funcs.items():
            if name.startswith("test_"):
                for kind in sorted(_reach(graph, name) - _marks(fn, tree)):
                    missing.append(f"{path.relative_to(TESTS)}::{name} needs @pytest.mark.{kind}")
    return missing


def test_every_multi_rank_and_cli_test_is_marked():
    assert unmarked() == []
