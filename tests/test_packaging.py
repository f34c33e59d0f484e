"""The wheel holds every package of the domain and nothing test-only (pyproject lists packages by hand)."""

from __future__ import annotations

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
