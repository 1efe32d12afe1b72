"""The declared dependencies match what the code imports.

`make run` installs the runtime lock (requirements.txt, compiled from requirements.in) and the package with
``--no-deps``, so a module that src/inferd imports but requirements.in does not name reaches the developers'
venvs through the dev lock and never reaches a user's: that once broke `make run` (``httpx``, imported by the
fleet) while every test passed. These checks read the source, not a venv, so they fail the moment such an
import is written.

- Every third-party distribution imported anywhere under src/inferd (at any depth: a lazy import runs too) is
  named directly in requirements.in; a package that only arrives as another's dependency may vanish with the
  next lock. inferd.bench, the benchmark behind `make bench` (which installs the dev lock), may also use
  requirements-dev.in.
- requirements.in names what pyproject's [project.dependencies] and its ``fast`` extra name together (the
  lock installs the optional backends too, so `make run` can serve any backend), and requirements-dev.in
  what the ``dev`` extra names.
- The ``fast`` extra's packages are imported only inside functions, so ``pip install inferd`` without the
  extra still starts and serves torch.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "inferd"
BENCH = SRC / "bench"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    """The distribution a requirements or pyproject line names, or None for blanks, comments and options."""
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        return None
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
    assert match, f"cannot read a requirement from {line!r}"
    return canonical(match.group(0))


def names_in(path: Path) -> set[str]:
    return {n for n in map(requirement_name, path.read_text().splitlines()) if n}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, at module level) for every absolute import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module.split(".")[0], node.lineno, id(node) in top_level))
    return found


def third_party(module: str) -> bool:
    return module not in sys.stdlib_module_names and module != "inferd" and module != "__future__"


@functools.cache
def installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    dists = installed().get(module)
    assert dists, (f"no installed distribution provides the module {module!r}; install the dev lock "
                   "(make install-dev) or fix the import")
    return {canonical(d) for d in dists}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_imported_distribution_is_declared_directly() -> None:
    runtime = names_in(ROOT / "requirements.in")
    dev = names_in(ROOT / "requirements-dev.in")
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        allowed = runtime | dev if BENCH in path.parents else runtime
        for module, line, _ in imports(path):
            if third_party(module) and not distributions(module) & allowed:
                missing.append(f"{path.relative_to(ROOT)}:{line} imports {module} "
                               f"({', '.join(sorted(distributions(module)))})")
    assert not missing, "imported but not named in requirements.in:\n" + "\n".join(missing)


def test_requirements_in_and_pyproject_name_the_same_packages() -> None:
    project = pyproject()
    declared = {requirement_name(d) for d in project["dependencies"]}
    fast = {requirement_name(d) for d in project["optional-dependencies"]["fast"]}
    assert names_in(ROOT / "requirements.in") == declared | fast
    dev = {requirement_name(d) for d in project["optional-dependencies"]["dev"]}
    assert names_in(ROOT / "requirements-dev.in") == dev


def test_the_locks_pin_every_declared_package() -> None:
    """A name added to a .in file without re-locking (`make lock`) would not be installed at all."""
    for source, lock in (("requirements.in", "requirements.txt"), ("requirements-dev.in", "requirements-dev.txt")):
        pinned = {canonical(m.group(1)) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==",
                                                             (ROOT / lock).read_text(), re.M)}
        assert names_in(ROOT / source) - pinned == set(), f"{source} names packages {lock} does not pin"


def test_optional_backends_are_imported_lazily() -> None:
    fast = {requirement_name(d) for d in pyproject()["optional-dependencies"]["fast"]}
    eager = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in sorted(SRC.rglob("*.py"))
             for module, line, top in imports(path)
             if top and third_party(module) and distributions(module) & fast]
    assert not eager, "imported at module level, so inferd fails to import without the fast extra:\n" + \
        "\n".join(eager)
