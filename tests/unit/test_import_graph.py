"""No import cycles inside src/inferd: the modules form layers, each importing only those below it.

Read from the source, not from a running interpreter: every import of one of inferd's own modules counts,
at any depth (an import inside a function that closes a cycle is a cycle worked around, not removed),
except those under ``if TYPE_CHECKING:``, which never run. ``from pkg import name`` is an import of the
submodule ``pkg.name`` when there is one, else of ``pkg``; a package's ``__init__`` is the package itself.
The checker is tested on small packages written for the purpose, with and without a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules_of(root: Path) -> dict[str, Path]:
    """Every module under the package folder ``root``, by dotted name (``pkg.sub`` for pkg/sub/__init__.py)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``); an ``else:`` branch runs, so counts."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(
                isinstance(n, ast.Name) and n.id == "TYPE_CHECKING"
                or isinstance(n, ast.Attribute) and n.attr == "TYPE_CHECKING" for n in ast.walk(node.test)):
            skipped |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return skipped


def _imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: level 1 is this module's package, each further level one up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in known else base


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports."""
    known = modules_of(root)
    return {name: {m for m in _imported(name, path, known) if m in known and m != name}
            for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = [f"{len(found)} import cycle(s) in src/inferd:"]
    for component in found:
        members = set(component)
        lines.append("  " + " <-> ".join(component))
        lines += [f"    {m} imports {', '.join(sorted(graph[m] & members))}" for m in component]
    return "\n".join(lines)


def test_inferd_has_no_import_cycles() -> None:
    graph = import_graph(ROOT / "src" / "inferd")
    found = cycles(graph)
    assert not found, describe(found, graph)


# -- the checker itself, on packages written for the test ------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_a_cycle_closed_inside_a_function_or_by_relative_imports_is_found(tmp_path: Path) -> None:
    pkg = write_package(tmp_path, {
        "pkg/__init__.py": "",
        # a <-> b, b's side inside a function (the usual work-around; still a cycle)
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": "def helper():\n    from pkg import a\n    return a\n",
        # top -> sub.x -> sub.y -> top, through relative imports and a package __init__
        "pkg/top.py": "import pkg.sub.x\n",
        "pkg/sub/__init__.py": "from . import y\n",
        "pkg/sub/x.py": "from .y import Y\n",
        "pkg/sub/y.py": "import json\nfrom ..top import T\nY = T = 1\n",
        # not in any cycle
        "pkg/leaf.py": "import os\nfrom pkg import a\n",
    })
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.sub"] == {"pkg.sub.y"} and graph["pkg.sub.y"] == {"pkg.top"}
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b"], ["pkg.sub.x", "pkg.sub.y", "pkg.top"]]
    message = describe(found, graph)
    assert "pkg.a <-> pkg.b" in message and "pkg.sub.y imports pkg.top" in message


def test_a_package_without_cycles_passes_and_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    pkg = write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": ("from typing import TYPE_CHECKING\nimport typing\n\nif TYPE_CHECKING:\n    from pkg.b import B\n"
                     "if typing.TYPE_CHECKING:\n    import pkg.c\nA = 1\n"),
        "pkg/b.py": "from pkg.a import A\nfrom pkg import c\n",
        "pkg/c.py": "from . import a\nfrom .a import *\n",
    })
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": set(), "pkg.b": {"pkg.a", "pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == []
    # The same import outside TYPE_CHECKING (here in its else branch, which runs) closes a cycle.
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n"
                              "    from pkg.b import B\n", encoding="utf-8")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]
