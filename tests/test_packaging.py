"""The wheel holds every package of the domain and nothing test-only (pyproject lists packages by hand)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_domain_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "mergeflow").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    for name in ("mergeflow.tasks", "mergeflow.flows", "mergeflow.deployments"):
        assert name in listed
    assert not any("fixtures" in name or "tests" in name for name in listed)


def _product_sources() -> list[Path]:
    """Every Python file the wheel ships: mergeflow/ and the directories pyproject maps into it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    roots = {REPO / "mergeflow", *(REPO / d for d in config["tool"]["setuptools"]["package-dir"].values())}
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


# The only places a process may signal itself: to end the way a command it stands for ended (a resident's
# caller dying of the signal that killed its forked command; a forked command ending as Python does on an
# uncaught Ctrl-C). Neither reads anything from the environment: the signal is one the process was given.
_ENDS_BY_A_SIGNAL_IT_WAS_GIVEN = {("deployments/cli.py", "end_process"), ("mergeflow/ops/resident_client.py", "_end_as")}


def test_the_package_carries_no_fault_hooks() -> None:
    """Faults are injected from outside the product (tests/syscall_faults.py): no module of the package
    reads a fault or test switch from the environment, signals its own process, or imports a faults module."""
    assert not (REPO / "mergeflow" / "io" / "faults.py").exists()
    assert importlib.util.find_spec("mergeflow.io.faults") is None
    sources = _product_sources()
    assert len(sources) > 50 and any(p.name == "jsonfiles.py" for p in sources)  # the scan sees the package
    found = []
    for path in sources:
        rel = path.relative_to(REPO)
        tree = ast.parse(path.read_text(), str(rel))
        allowed = {id(call) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                   and (rel.as_posix(), fn.name) in _ENDS_BY_A_SIGNAL_IT_WAS_GIVEN for call in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.search(r"(^|_)FAULTS?(_|$)|MERGEFLOW_TEST|(^|_)HOOKS?(_|$)", node.value):
                found.append(f"{rel}:{node.lineno}: environment name {node.value!r}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.kill", "os.killpg", "signal.raise_signal") \
                    and "getpid" in ast.unparse(node) and id(node) not in allowed:
                found.append(f"{rel}:{node.lineno}: signals its own process: {ast.unparse(node)}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                names += [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                found += [f"{rel}:{node.lineno}: imports {n}" for n in names if re.search(r"(^|[._])faults?($|[._])", n)]
    assert found == []
