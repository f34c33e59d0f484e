"""Checkpoint sources (mergeflow/sources/): one protocol, one module per kind, one registry.

The rule that keeps adding a kind to one module and one registry row: nothing outside
mergeflow/sources/ (and the byte-level readers in mergeflow/formats/) branches on a kind's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mergeflow import errors as E
from mergeflow.records import CheckpointInputs
from mergeflow.sources.base import CheckpointSource, Indexing
from mergeflow.sources.dcp import DcpSource
from mergeflow.sources.registry import FALLBACK, SOURCES, source_for, source_named
from mergeflow.sources.verl import VerlSource

REPO = Path(__file__).resolve().parents[1]
# The installed package: mergeflow/ plus the task, flow and deployment packages mapped into it (pyproject).
PACKAGE_DIRS = ("mergeflow", "tasks", "flows", "deployments")
# Where a kind may be named: the sources themselves, and the byte-level readers they use.
EXEMPT_DIRS = ("mergeflow/sources/",)
BYTE_LEVEL_READERS = tuple(f"mergeflow/formats/{name}.py" for name in
                           ("dcp", "dcp_layout", "dcp_pickle", "rank_files", "rank_pickle", "zip_records", "verl_checkpoint"))
# Detection helpers: called only by the sources.
DETECTORS = {"format_of", "is_dcp_dir"}


def kind_branches(source: str, kinds: set[str]) -> list[str]:
    """Every place `source` branches on a checkpoint kind: a comparison with (or membership in a literal of)
    a kind's name, a dict or `match` keyed by one, or a call of a detection helper."""
    found = []

    def is_kind(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in kinds
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_kind(e) for e in node.elts)
        return False

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(is_kind(n) for n in (node.left, *node.comparators)):
            found.append(f"line {node.lineno}: compares with a kind: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and any(k is not None and is_kind(k) for k in node.keys):
            found.append(f"line {node.lineno}: a dict keyed by kind")
        elif isinstance(node, ast.MatchValue) and is_kind(node.value):
            found.append(f"line {node.lineno}: a match case on a kind")
        elif isinstance(node, (ast.Name, ast.Attribute)) and (node.id if isinstance(node, ast.Name) else node.attr) in DETECTORS:
            found.append(f"line {node.lineno}: uses a detection helper")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in DETECTORS:
            found.append(f"imports a detection helper ({node.name})")
    return found


def test_the_checker_finds_every_form_the_branches_took() -> None:
    """The forms mergeflow used before sources/ existed, and a few more: each one is found."""
    kinds = {s.kind for s in SOURCES}
    branches = [
        'if plan.checkpoint.format == "dcp":\n    pass',
        'x = "torch DCP" if plan.checkpoint.format == "dcp" else "FSDP"',
        'if fmt == "verl":\n    pass',
        'if not has_meta and checkpoint.format == "verl":\n    pass',
        'if "dcp" != kind:\n    pass',
        'if kind in ("verl", "other"):\n    pass',
        'hasher = {"verl": a, "dcp": b}[kind]',
        'match kind:\n    case "dcp":\n        pass',
        'if format_of(actor) == "x":\n    pass',
        'from mergeflow.formats.checkpoint_dir import format_of',
        'ok = is_dcp_dir(path)',
    ]
    for code in branches:
        assert kind_branches(code, kinds), code
    # Naming a kind is not branching on it: a persisted default, a message, a registry lookup.
    for code in ('format: str = "verl"', 'raise E("a DCP checkpoint carries no model config")',
                 'source = source_named(plan.checkpoint.format)', 'view.format != "B"'):
        assert not kind_branches(code, kinds), code


def test_nothing_outside_sources_branches_on_a_checkpoint_kind() -> None:
    kinds = {s.kind for s in SOURCES}
    files = sorted(p for d in PACKAGE_DIRS for p in (REPO / d).rglob("*.py"))
    assert len(files) > 100, "the package was not found where the test looks"
    offenders = {}
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(EXEMPT_DIRS) or rel in BYTE_LEVEL_READERS:
            continue
        found = kind_branches(path.read_text(encoding="utf-8"), kinds)
        if found:
            offenders[rel] = found
    assert not offenders, ("branch on a checkpoint kind outside mergeflow/sources/: ask the source instead "
                           f"(docs/extending.md): {offenders}")


def test_the_registry_holds_one_source_per_kind_each_complete() -> None:
    assert [s.kind for s in SOURCES] == ["dcp", "verl"]  # detection order: the DCP's files are the more specific
    assert len({s.kind for s in SOURCES}) == len(SOURCES)
    assert FALLBACK in SOURCES
    for source in SOURCES:
        assert isinstance(source, CheckpointSource)
        assert source_named(source.kind) is source
        # Each indexing mode's methods are the source's own, not the protocol's refusal.
        own = {name for name in ("index_units", "index_file", "read_layouts")
               if getattr(type(source), name) is not getattr(CheckpointSource, name)}
        expected = {"index_units", "index_file"} if source.indexing is Indexing.PER_FILE else {"read_layouts"}
        assert own == expected, source.kind


def test_an_unknown_kind_is_one_clear_checkpoint_error() -> None:
    with pytest.raises(E.CheckpointError, match="unknown checkpoint kind 'gguf'; mergeflow reads dcp, verl"):
        source_named("gguf")


def test_detection_reads_the_listing_in_order(tmp_path: Path) -> None:
    def directory(name: str, *files: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        for file in files:
            (path / file).write_bytes(b"")
        return path

    assert isinstance(source_for(directory("dcp", ".metadata", "__0_0.distcp")), DcpSource)
    assert isinstance(source_for(directory("verl", "fsdp_config.json", "model_world_size_1_rank_0.pt")), VerlSource)
    # Both: the DCP's files say the most (verl never writes .distcp files).
    assert isinstance(source_for(directory("both", "fsdp_config.json", ".metadata", "__0_0.distcp")), DcpSource)
    # Neither, or an unfinished DCP save: the fallback, whose reader says what is missing.
    for name, files in (("empty", ()), ("unfinished", ("__0_0.distcp",))):
        path = directory(name, *files)
        assert source_for(path) is FALLBACK
        with pytest.raises(E.CheckpointError, match="fsdp_config.json is missing" if not files else "did not finish"):
            FALLBACK.listed_files(path)


def test_the_manifest_record_and_the_label_are_the_sources() -> None:
    """Field order is part of the manifest's bytes: verl's world size first, a DCP's layout first."""
    verl = CheckpointInputs("/ckpt", "/ckpt/huggingface", 4, 2, ("r0", "r1", "r2", "r3"), "0" * 64, format="verl")
    dcp = CheckpointInputs("/ckpt", "/base/transformer", 3, 0, (".metadata",), "0" * 64, format="dcp")
    assert list(source_named("verl").checkpoint_record(verl).items()) == [("world_size", 4), ("fsdp_version", 2)]
    assert list(source_named("dcp").checkpoint_record(dcp).items()) == [("layout", "dcp"), ("world_size", 3)]
    assert source_named("verl").label(verl) == "FSDP v2"
    assert source_named("dcp").label(dcp) == "torch DCP"
    assert source_named("verl").marker_files == ("fsdp_config.json",) and source_named("dcp").marker_files == ()
    assert source_named("verl").requires_lora_meta and not source_named("dcp").requires_lora_meta
