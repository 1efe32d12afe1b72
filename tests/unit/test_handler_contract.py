"""The handler contract is the ``Handler`` base class (core/tasks/base.py): every member anything reads is declared
there with its default, so no module probes a handler with ``getattr``/``hasattr``; and ``module:Class`` loads
only a class that derives from it.

Read from the source. A ``getattr``/``hasattr`` call is on a handler when its object is: a name or attribute
path whose last part is ``handler`` or ends in ``handler`` (``slot.handler``, ``new_handler``); a parameter or
variable annotated with a handler type (``Handler``, ``ModelTask``, the gate's ``GatedTask``, or any class deriving
from them); an attribute of ``self`` that a method of the class sets from such a parameter (``self.inner =
inner``); or ``self``/``cls`` in a method of a handler class. Only
core/tasks/base.py, where the defaults are declared, is exempt. A getattr on something else (a model config, a
tokenizer, argparse's namespace, a slot) is not a handler's business and is not counted.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.core.errors import ModelLoadError
from inferd.core.tasks.handlers import handler_for

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "inferd"
EXEMPT = {Path("core/tasks/base.py")}
PROBES = {"getattr", "hasattr"}
# The contract and the gate's view of it; classes deriving from them (by name, in any scanned module) join.
ROOTS = {"Handler", "ModelTask", "GatedTask"}


def handler_classes(trees: list[ast.Module]) -> set[str]:
    """The names of the contract's classes and every class that derives from one of them, to a fixpoint."""
    found = set(ROOTS)
    classes = [node for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    grew = True
    while grew:
        grew = False
        for cls in classes:
            bases = {ast.unparse(b).rpartition(".")[2] for b in cls.bases}
            if cls.name not in found and (bases & found or cls.name.endswith("Handler")):
                found.add(cls.name)
                grew = True
    return found


class _Finder(ast.NodeVisitor):
    def __init__(self, handlers: set[str]) -> None:
        self.typed = re.compile(r"\b(" + "|".join(sorted(handlers)) + r"|\w+Handler)\b")
        self.handlers = handlers
        self.scopes: list[set[str]] = [set()]  # names bound to a handler, per function
        self.in_handler_class: list[bool] = [False]
        self.self_attrs: list[set[str]] = [set()]  # per class: attributes of self that hold a handler
        self.found: list[tuple[int, str]] = []

    def _annotated(self, annotation: ast.expr | None) -> bool:
        return annotation is not None and bool(self.typed.search(ast.unparse(annotation)))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
        self.in_handler_class.append(bool(bases & self.handlers) or node.name in self.handlers)
        self.self_attrs.append(self._handler_attrs(node))
        self.generic_visit(node)
        self.self_attrs.pop()
        self.in_handler_class.pop()

    def _handler_attrs(self, cls: ast.ClassDef) -> set[str]:
        """The attributes a class declares with a handler type, or sets in a method from a parameter of one."""
        out = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
               and self._annotated(n.annotation)}
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            typed = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs] if self._annotated(a.annotation)}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in typed:
                    out |= {t.attr for t in n.targets if isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name) and t.value.id == "self"}
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Attribute) and \
                        self._annotated(n.annotation):
                    out.add(n.target.attr)
        return out

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        bound = set(self.scopes[-1])
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        if self.in_handler_class[-1] and params and not isinstance(node, ast.Lambda):
            bound.add(params[0].arg)  # self or cls
        bound |= {a.arg for a in params if self._annotated(a.annotation)}
        self.scopes.append(bound)
        self.in_handler_class.append(False)  # a class-level flag does not reach nested functions' own classes
        self.generic_visit(node)
        self.in_handler_class.pop()
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function  # type: ignore[assignment]

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name) and self._annotated(node.annotation):
            self.scopes[-1].add(node.target.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in PROBES and node.args:
            target = node.args[0]
            text = ast.unparse(target)
            last = text.rpartition(".")[2].lower()
            on_handler = (isinstance(target, ast.Name | ast.Attribute) and last.endswith("handler")) or (
                isinstance(target, ast.Name) and target.id in self.scopes[-1]) or (
                isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self" and target.attr in self.self_attrs[-1])
            if on_handler:
                self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def probes(files: dict[Path, str]) -> Iterator[str]:
    """``path:line: call`` for each getattr/hasattr/setattr/delattr on a handler in the given sources."""
    trees = {path: ast.parse(text, str(path)) for path, text in files.items()}
    handlers = handler_classes(list(trees.values()))
    for path, tree in sorted(trees.items()):
        finder = _Finder(handlers)
        finder.visit(tree)
        yield from (f"{path}:{line}: {call}" for line, call in finder.found)


def test_no_module_probes_a_handler_outside_the_contract() -> None:
    files = {p.relative_to(SRC): p.read_text(encoding="utf-8") for p in sorted(SRC.rglob("*.py"))}
    found = list(probes({p: t for p, t in files.items() if p not in EXEMPT}))
    assert not found, ("handler members probed outside core/tasks/base.py (declare them on Handler, with a "
                       "default, and read them):\n  " + "\n  ".join(found))


def test_the_scan_finds_probes_by_name_by_type_and_on_self_and_nothing_else() -> None:
    files = {
        Path("a.py"): (
            "def f(slot, new_handler, config, args, head):\n"
            "    getattr(slot.handler, 'tokenizer', None)\n"          # by name
            "    hasattr(new_handler, 'warmup')\n"                    # by name
            "    getattr(config, 'max_position_embeddings', 512)\n"   # a config: not counted
            "    getattr(args, 'model', None)\n"                      # argparse: not counted
            "    getattr(head.group, 'pads', True)\n"                 # a slot: not counted
            "def g(p: GatedTask, x: 'Handler | None', n: int):\n"
            "    getattr(p, 'multi_label', False)\n"                  # by type
            "    hasattr(x, 'describe')\n"                            # by type, quoted
            "    getattr(n, 'real')\n"
        ),
        Path("b.py"): (
            "from a import Handler\n"
            "class Mine(Handler):\n"
            "    def close(self):\n"
            "        getattr(self, 'runner', None)\n"                 # self in a handler class
            "class Sub(Mine):\n"
            "    def run(self):\n"
            "        h: Mine = self\n"
            "        hasattr(h, 'x')\n"                               # a variable annotated with a subclass
            "class Other:\n"
            "    def __init__(self, inner: Handler, config):\n"
            "        self.inner, self.config = inner, config\n"
            "        self.wrapped = inner\n"
            "    def close(self):\n"
            "        getattr(self, 'runner', None)\n"                 # not a handler class
            "        getattr(self.config, 'x', None)\n"               # not a handler
            "        hasattr(self.wrapped, 'warmup')\n"               # an attribute set from a handler parameter
        ),
    }
    found = list(probes(files))
    assert sorted(f.split(": ", 1)[0] for f in found) == ["a.py:2", "a.py:3", "a.py:8", "a.py:9", "b.py:16",
                                                          "b.py:4", "b.py:8"]


def test_a_plugin_class_that_does_not_derive_from_handler_is_refused_naming_it() -> None:
    with pytest.raises(ModelLoadError, match=r"collections:OrderedDict.*inferd\.core\.tasks\.base\.Handler"):
        handler_for("collections:OrderedDict")


def test_a_plugin_class_that_leaves_a_stage_unimplemented_is_refused_naming_it(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    (tmp_path / "half_plugin.py").write_text(
        "from inferd.core.tasks.base import Handler\n"
        "class Half(Handler):\n"
        "    def load(self, spec, device): pass\n"
        "    def preprocess(self, inputs): return []\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"'half_plugin:Half' cannot be built: .*infer"):
        handler_for("half_plugin:Half")


# -- the batch path's own contracts: a batch's group and a runner's capabilities are typed, never probed ----------

BATCH_PATH = ("core/batcher.py", "core/engine.py", "core/worker.py", "core/slots.py", "core/outcomes.py")
# What a runner can do was copied attribute by attribute (runner -> handler -> description -> slot); it is one value
# now (core/capabilities.py), and these names read apart from it would be copies again.
CAPABILITY_FIELDS = ("pads", "can_use_all_threads", "stages")


def batch_path_breaches(sources: dict[str, str]) -> Iterator[str]:
    """A probe of an item's group (``getattr``/``hasattr``), a ``type: ignore`` on a line reading an item's group
    (a cast back to the slot it always is), or a capability read or set apart from its ``capabilities`` value."""
    for name, text in sources.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
                    and node.args and "group" in ast.unparse(node.args[0])):
                yield f"{name}:{node.lineno}: {ast.unparse(node)}"
            if (isinstance(node, ast.Attribute) and node.attr in CAPABILITY_FIELDS
                    and not ast.unparse(node.value).endswith("capabilities")):
                yield f"{name}:{node.lineno}: {ast.unparse(node)}"
        for number, line in enumerate(text.splitlines(), 1):
            if ".group" in line and "type: ignore" in line:
                yield f"{name}:{number}: {line.strip()}"


def test_the_batch_path_reads_its_group_and_capabilities_typed() -> None:
    found = list(batch_path_breaches({p: (SRC / p).read_text(encoding="utf-8") for p in BATCH_PATH}))
    assert not found, "probed or cast on the batch path:\n" + "\n".join(found)


def test_the_batch_path_scan_finds_a_probe_a_cast_and_a_copy() -> None:
    found = list(batch_path_breaches({"x.py": (
        "floor = 0.5 if getattr(head.group, 'pads', True) else 0.0\n"     # a probe of the group
        "slot: Slot = batch[0].group  # type: ignore[assignment]\n"        # a cast back
        "self.pads = handler.pads\n"                                       # a copy, twice on one line
        "ok = head.slot.capabilities.pads and slot.capabilities.can_use_all_threads\n"  # read where needed: fine
    )}))
    assert sorted(f.split(": ", 1)[0] for f in found) == ["x.py:1", "x.py:2", "x.py:3", "x.py:3"]
