"""One name, one meaning: no two modules of ``mct`` define the same public module-level
name for different things (a reader who meets ``prepare`` or ``Prepared`` knows which).
The same definition in two places (``log = logging.getLogger(__name__)``, a lazy module
handle) is one thing, and allowed."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mct"


def _definitions(tree: ast.Module) -> list[tuple[str, str]]:
    """(name, what defines it) for each public module-level function, class and assignment."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, f"{type(node).__name__} {ast.dump(node)}"))
        elif isinstance(node, ast.Assign):
            out += [(t.id, ast.dump(node.value)) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out.append((node.target.id, ast.dump(node.value)))
    return [(n, d) for n, d in out if not n.startswith("_")]


def public_names() -> dict[str, dict[str, set[str]]]:
    """{name: {definition: {modules}}} over src/mct."""
    names: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(SRC.rglob("*.py")):
        for name, definition in _definitions(ast.parse(path.read_text(), str(path))):
            names[name][definition].add(str(path.relative_to(SRC)))
    return names


def test_no_public_name_means_two_things():
    clashes = {name: sorted(m for ms in defs.values() for m in ms)
               for name, defs in public_names().items() if len(defs) > 1}
    assert not clashes, f"one public name defined differently in several modules: {clashes}"


def test_the_check_sees_a_clash():
    a = ast.parse("def prepare(x):\n    return x\nFORMAT = 'a'\nlog = f(__name__)\n")
    b = ast.parse("def prepare(y):\n    return y\nFORMAT = 'b'\nlog = f(__name__)\n")
    defs_a, defs_b = dict(_definitions(a)), dict(_definitions(b))
    assert defs_a["prepare"] != defs_b["prepare"] and defs_a["FORMAT"] != defs_b["FORMAT"]
    assert defs_a["log"] == defs_b["log"]
