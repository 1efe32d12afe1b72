"""No module outside core/tasks/ branches on a task's or an output's name: what differs between tasks is the task
object's (core/tasks/task.py, one per task, looked up by name in core/tasks/kinds.py), so a new task or output is
its own file and a line in the registry, not a new rung on ladders across the house.

Read from the source: a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``, ``is not``) one of whose operands is
a task's or an output's name as a string literal, or a tuple, list or set of literals holding one. core/tasks/
(where the names live) and bench/ (which names the models it loads) are exempt. The wire modules read what differs
between tasks from the task object (``takes_pairs``) or from a table of their own keyed by the task or output
object (TEI's POST / and model_type, /predict's results, /v1/encode's and /embed_sparse's writers).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "inferd"
EXEMPT = ("core/tasks/", "bench/")
NAMES = {"embedding", "rerank", "classification", "sparse", "multivector", "dense"}
OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
# path -> how many such comparisons it still holds: none (kept, empty, so that the scan's two tests stand as they
# were written while the api/ modules still branched).
REMAINING: dict[str, int] = {}


def _names(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def name_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every comparison with a task's or an output's name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, OPS) for op in node.ops):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in sorted(_names(operand))]
    return found


def scan() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(EXEMPT):
            continue
        if found := name_branches(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            out[rel] = found
    return out


def test_no_module_outside_core_tasks_branches_on_a_task_or_output_name() -> None:
    found = scan()
    grown = {path: hits for path, hits in found.items() if len(hits) > REMAINING.get(path, 0)}
    assert not grown, ("branches on a task's or an output's name outside core/tasks/ (ask the task object: "
                       f"core/tasks/kinds.py task_of): {grown}")


def test_the_remaining_list_only_shrinks() -> None:
    """A module that no longer branches leaves REMAINING (so that it cannot start again unnoticed)."""
    found = scan()
    stale = {path: n for path, n in REMAINING.items() if len(found.get(path, [])) < n}
    assert not stale, f"fewer branches than REMAINING says, lower it: {stale}"


def test_handler_for_picks_a_built_in_task_s_handler_from_its_table_not_a_ladder() -> None:
    """core/tasks/handlers.py is inside the exempt package; its task names are HANDLERS' keys, never compared."""
    path = SRC / "core" / "tasks" / "handlers.py"
    assert name_branches(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_scan_finds_every_form_of_such_a_branch() -> None:
    code = ('if task == "embedding": pass\n'
            'if "rerank" != kind: pass\n'
            'if kind in ("sparse", "other"): pass\n'
            'if "dense" in outputs: pass\n'
            'if kind is "multivector": pass\n'
            'if task not in {"classification"}: pass\n'
            'x = {"embedding": 1}\n'  # a table is not a branch
            'if task == "embeddings": pass\n')
    assert name_branches(ast.parse(code)) == [(1, "embedding"), (2, "rerank"), (3, "sparse"), (4, "dense"),
                                              (5, "multivector"), (6, "classification")]
