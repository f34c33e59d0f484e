"""The plain form of a record that the shard and adapter fingerprints hash, and the installed versions a merge reads.

A staged shard is reused by a rerun only when its record's fingerprint matches the plan's (tests/test_resume.py),
so the plain form must be exactly what `dataclasses.asdict` gives: the same values and container types, for
every kind of write the planner makes.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib import metadata
from typing import Any

import pytest

from mergeflow.formats import manifest
from mergeflow.formats.manifest import fingerprint, installed_version, plain, producer_versions
from mergeflow.records import (
    ArchitectureOp,
    BaseCopy,
    BaseModelSource,
    CheckpointSource,
    ComputedSource,
    LoraFuse,
    TensorLayout,
    TensorWrite,
)


def _layout(key: str, shard_dim: int | None = 0) -> TensorLayout:
    return TensorLayout(key=key, dtype="bfloat16", shape=(8, 4), shard_dim=shard_dim, chunk_ranks=((0, 2), (1, 3)),
                        chunk_shapes=((4, 4), (4, 4)))


def _writes() -> list[TensorWrite]:
    plain_write = TensorWrite("a.weight", "model.a.weight", _layout("model.a.weight"), "bfloat16")
    fused = TensorWrite("b.weight", "b.base_layer.weight", _layout("b.base_layer.weight", None), "float32", LoraFuse(
        param="weight", module="b", scaling=0.5, rank=4, base=BaseModelSource(file="t.safetensors", key="b.weight"),
        lora_A=CheckpointSource(_layout("b.lora_A.weight")), lora_B=CheckpointSource(_layout("b.lora_B.weight"))))
    copied = TensorWrite("c.weight", "c.weight", _layout("c.weight"), "bfloat16",
                         BaseCopy(base=BaseModelSource(file="t.safetensors", key="c.weight")))
    converted = TensorWrite("qkv.weight", "q.weight", _layout("q.weight"), "bfloat16", ArchitectureOp(
        op="concat", inputs=(CheckpointSource(_layout("q.weight")), ComputedSource(fused)),
        params={"dim": 0, "scale": 1.5, "name": "x", "none": None}))
    return [plain_write, fused, copied, converted]


@pytest.mark.parametrize("index", range(4), ids=["plain", "lora_fuse", "base_copy", "architecture_op"])
def test_plain_is_exactly_what_asdict_gives(index: int) -> None:
    write = _writes()[index]
    expected = asdict(write)
    got = plain(write)
    assert got == expected

    def shape(value: Any) -> Any:  # the container types, all the way down (== alone takes a tuple for a list)
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, [shape(v) for v in value])
        return type(value).__name__

    assert shape(got) == shape(expected)
    assert fingerprint([(got, 0)]) == fingerprint([(expected, 0)])


def test_plain_leaves_other_values_as_asdict_would() -> None:
    body = {"k": (1, [2.5, None]), ("t", 1): True}
    assert plain(body) == body and plain(body) is not body


def test_installed_versions_are_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    assert installed_version("torch") == metadata.version("torch")
    assert installed_version("no-such-distribution-mergeflow") is None
    first = producer_versions()
    assert first["torch"] == metadata.version("torch") and "no-such-distribution-mergeflow" not in first

    def unread(name: str) -> str:
        raise AssertionError(f"read {name}'s metadata again")

    monkeypatch.setattr(manifest.metadata, "version", unread)
    assert producer_versions() == first
