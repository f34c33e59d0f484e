"""bench/export_digests.py's comparison: any byte of any published file counts, except the manifest's producer version."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "export_digests.py"


@pytest.fixture(scope="module")
def digests() -> ModuleType:
    spec = importlib.util.spec_from_file_location("export_digests", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _manifest(version: str = "0.1.0", torch_version: str = "2.13.0", **extra: Any) -> dict[str, Any]:
    # As mergeflow/export/publish.py writes it: the producer versions among the other fields.
    return {"schema_version": 1, "artifact_type": "diffusers_transformer", "dtype": "float32",
            "files": {"config.json": "ab" * 32}, "mergeflow": "0.1.0",
            "producer": {"mergeflow": version, "torch": torch_version}, "verification": {"integrity": "passed"},
            **extra}


def _export(root: Path, *, manifest: dict[str, Any] | None = None, indent: int = 2, weights: bytes = b"\x00\x01",
            adapter_manifest: dict[str, Any] | None = None) -> Path:
    """A tiny published artifact: weights, a config and the manifest (and a nested adapter manifest)."""
    (root / "case").mkdir(parents=True)
    (root / "case" / "model.safetensors").write_bytes(weights)
    (root / "case" / "config.json").write_text(json.dumps({"hidden": 4}, indent=2) + "\n")
    (root / "case" / "merge_manifest.json").write_text(json.dumps(manifest or _manifest(), indent=indent) + "\n")
    if adapter_manifest is not None:
        (root / "case" / "lora_adapter").mkdir()
        (root / "case" / "lora_adapter" / "merge_manifest.json").write_text(json.dumps(adapter_manifest, indent=2))
    return root


def _compare(digests: ModuleType, tmp_path: Path, a: Callable[[Path], Path], b: Callable[[Path], Path]) -> list[str]:
    da = {"case": digests.tree_digests(a(tmp_path / "a") / "case")}
    db = {"case": digests.tree_digests(b(tmp_path / "b") / "case")}
    lines: list[str] = digests.compare_digests(da, db)
    _, same = digests.case_table(da, db)
    assert same == (not lines)
    return lines


def test_the_same_bytes_compare_identical(digests: ModuleType, tmp_path: Path) -> None:
    assert _compare(digests, tmp_path, _export, _export) == []


def test_only_the_producer_version_is_ignored(digests: ModuleType, tmp_path: Path) -> None:
    newer = _manifest(version="0.2.0")
    assert _compare(digests, tmp_path, lambda r: _export(r, adapter_manifest=_manifest()),
                    lambda r: _export(r, manifest=newer, adapter_manifest=newer)) == []


@pytest.mark.parametrize("change", ["torch version", "indent", "a field", "a field and the version", "weights",
                                    "a missing file"])
def test_any_other_difference_is_reported(digests: ModuleType, tmp_path: Path, change: str) -> None:
    b: dict[str, Callable[[Path], Path]] = {
        "torch version": lambda r: _export(r, manifest=_manifest(torch_version="2.14.0")),
        "indent": lambda r: _export(r, indent=1),  # the same JSON values, other bytes
        "a field": lambda r: _export(r, manifest=_manifest(dtype="bfloat16")),
        "a field and the version": lambda r: _export(r, manifest=_manifest(version="0.2.0", dtype="bfloat16")),
        "weights": lambda r: _export(r, weights=b"\x00\x02"),
        "a missing file": lambda r: _export(r, adapter_manifest=_manifest()),
    }
    lines = _compare(digests, tmp_path, _export, b[change])
    assert len(lines) == 1, lines


def test_a_version_change_in_another_field_is_not_mistaken_for_the_producer_s(digests: ModuleType, tmp_path: Path) -> None:
    # The top-level "mergeflow" key holds the same string as the producer's: only the producer's may be cut.
    moved = _manifest(version="0.2.0")
    moved["mergeflow"] = "0.2.0"
    lines = _compare(digests, tmp_path, _export, lambda r: _export(r, manifest=moved))
    assert len(lines) == 1 and "beyond the producer version" in lines[0], lines


def test_the_compare_command_exits_1_on_a_difference_and_0_otherwise(digests: ModuleType, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    files = {}
    for name, manifest in (("a", _manifest()), ("b", _manifest(version="9")), ("c", _manifest(dtype="float16"))):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"case": digests.tree_digests(_export(tmp_path / name, manifest=manifest) / "case")}))
    assert digests.main(["compare", str(files["a"]), str(files["b"])]) == 0
    assert "IDENTICAL: 1 cases, 3 files" in capsys.readouterr().out
    assert digests.main(["compare", str(files["a"]), str(files["c"]), "--outputs", str(tmp_path / "a"),
                         str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "case/merge_manifest.json: sha256 differs" in out and 'dtype: A="float32" B="float16"' in out
