"""The one weight reader: single file or index, and every malformed layout refused with the caller's error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mergeflow.errors import ArtifactInvalidError, BaseModelError, PathSafetyError
from mergeflow.formats.weight_index import (
    read_stored_tensor,
    read_weight_headers,
    read_weight_map,
    read_weights,
)

NAME = "diffusion_pytorch_model.safetensors"
INDEX = f"{NAME}.index.json"


def _single(root: Path) -> Path:
    root.mkdir()
    save_file({"a": torch.ones(2, 3), "b": torch.arange(4, dtype=torch.int64)}, str(root / NAME), metadata={"format": "pt"})
    return root


def _sharded(root: Path, weight_map: dict[str, str] | None = None) -> Path:
    root.mkdir()
    save_file({"a": torch.ones(2, 3)}, str(root / "part-1.safetensors"), metadata={"format": "pt"})
    save_file({"b": torch.arange(4, dtype=torch.int64)}, str(root / "part-2.safetensors"))
    weight_map = weight_map or {"a": "part-1.safetensors", "b": "part-2.safetensors"}
    (root / INDEX).write_text(json.dumps({"metadata": {"total_size": 56}, "weight_map": weight_map}))
    return root


def test_single_and_sharded_weights_read_the_same(tmp_path: Path) -> None:
    single, sharded = _single(tmp_path / "single"), _sharded(tmp_path / "sharded")
    expected = {"a": ("float32", (2, 3)), "b": ("int64", (4,))}
    assert read_weight_headers(single, NAME, BaseModelError, "the base") == expected
    assert read_weight_headers(sharded, NAME, BaseModelError, "the base") == expected
    assert read_weight_map(single, NAME, BaseModelError, "the base") == {"a": NAME, "b": NAME}
    assert read_weight_map(sharded, NAME, BaseModelError, "the base") == {"a": "part-1.safetensors", "b": "part-2.safetensors"}
    stored = read_weights(sharded, NAME, ArtifactInvalidError, "the artifact")
    assert (stored.index, stored.total_size) == (INDEX, 56)
    assert stored.metadata == {"part-1.safetensors": {"format": "pt"}, "part-2.safetensors": {}}
    for root in (single, sharded):
        assert torch.equal(read_stored_tensor(root, NAME, "b", BaseModelError, "the base"), torch.arange(4))
        assert read_stored_tensor(root, NAME, "absent", BaseModelError, "the base") is None


def _both(root: Path) -> None:
    save_file({"a": torch.ones(2, 3)}, str(root / NAME))


def _duplicate_key(root: Path) -> None:
    (root / INDEX).write_text('{"weight_map": {"a": "part-1.safetensors", "a": "part-2.safetensors"}}')


def _misplaced(root: Path) -> None:
    (root / INDEX).write_text(json.dumps({"weight_map": {"a": "part-2.safetensors", "b": "part-1.safetensors"}}))


def _unheld(root: Path) -> None:
    (root / INDEX).write_text(json.dumps({"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors", "c": "part-2.safetensors"}}))


def _missing_shard(root: Path) -> None:
    (root / "part-2.safetensors").unlink()


def _symlinked_shard(root: Path) -> None:
    (root / "part-2.safetensors").rename(root.parent / "elsewhere.safetensors")
    (root / "part-2.safetensors").symlink_to(root.parent / "elsewhere.safetensors")


def _damaged_shard(root: Path) -> None:
    with open(root / "part-2.safetensors", "ab") as handle:
        handle.write(b"\0")


def _no_weight_map(root: Path) -> None:
    (root / INDEX).write_text(json.dumps({"weight_map": {}}))


BREAKAGES = {
    "both_forms": (_both, r"holds both diffusion_pytorch_model.safetensors and diffusion_pytorch_model.safetensors.index.json"),
    "duplicate_key": (_duplicate_key, r"is not valid JSON: duplicate key 'a'"),
    "misplaced": (_misplaced, r"sharded/part-1.safetensors holds a, which .*index.json places elsewhere"),
    "unheld": (_unheld, r"lists c but no shard holds it"),
    "missing_shard": (_missing_shard, r"names part-2.safetensors, which is missing"),
    "symlinked_shard": (_symlinked_shard, r"part-2.safetensors of the base is a symlink"),
    "damaged_shard": (_damaged_shard, r"weights sharded/part-2.safetensors of the base are damaged"),
    "no_weight_map": (_no_weight_map, r"has no weight_map"),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_malformed_weights_are_refused_with_the_callers_error(tmp_path: Path, case: str) -> None:
    breakage, message = BREAKAGES[case]
    root = _sharded(tmp_path / "sharded")
    breakage(root)
    with pytest.raises(BaseModelError, match=message):
        read_weights(root, NAME, BaseModelError, "the base")
    with pytest.raises(ArtifactInvalidError):
        read_weights(root, NAME, ArtifactInvalidError, "the artifact")


def test_neither_form_is_an_incomplete_model(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(BaseModelError, match=r"empty/ has no .* nor .*; the base is incomplete"):
        read_weights(tmp_path / "empty", NAME, BaseModelError, "the base")


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub\\x.safetensors", ["a"]])
def test_index_names_that_could_escape_are_refused_before_any_file_is_read(tmp_path: Path, name: object) -> None:
    root = _sharded(tmp_path / "sharded", {"a": "part-1.safetensors", "b": name})  # type: ignore[dict-item]
    with pytest.raises(PathSafetyError):
        read_weights(root, NAME, BaseModelError, "the base")
