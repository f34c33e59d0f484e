"""The one reader of a model's safetensors weights: one file, or shards named by an index.

Diffusers and Transformers store a model's weights either as one `<weights_name>` file or as
shards listed by `<weights_name>.index.json` (`{"metadata": {"total_size": n}, "weight_map":
{tensor: shard file}}`). The base checks, LoRA-only fusion, the native MiniMax H3 check and the
artifact check (`mergeflow test`) all read weights through here, so one set of rules decides
what well-formed weights are:

- exactly one of the two forms is present: with both, loaders disagree on which one is read
  (Diffusers prefers the index, Transformers the single file);
- the index is strict JSON (duplicate keys refused), its `weight_map` a non-empty object of
  tensor -> plain relative file name (nothing that could escape the component directory);
- every weight file is a plain file, never a symlink (mergeflow never follows links), with a
  valid safetensors header;
- each tensor is held by exactly the shard the index names, and every listed tensor is held.

Callers choose the error type (a damaged base is a `BaseModelError`, a damaged artifact an
`ArtifactInvalidError`) and how the owner is named in messages. Rules that only one caller has
(an artifact's `format: pt` metadata and exact `total_size`, promises of mergeflow's own writer
that real bases need not keep) stay with that caller, which reads them from `StoredWeights`.

No torch at import: `mergeflow test` reads headers in about a second without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.errors import ArtifactInvalidError, MergeflowError
from mergeflow.formats.safetensors_format import HeaderEntry, read_header
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.io.paths import check_relative_name

if TYPE_CHECKING:  # torch only where a tensor's values are read
    import torch

# The weight file names mergeflow reads and writes: Diffusers models, then Transformers models.
WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")

Headers = dict[str, tuple[str, tuple[int, ...]]]  # tensor -> (torch dtype name, shape)


def index_name(weights_name: str) -> str:
    """The index file that lists the shards of `weights_name`."""
    return f"{weights_name}.index.json"


@dataclass(frozen=True)
class StoredWeights:
    """A component's weights as their headers describe them, checked by the rules above."""

    entries: dict[str, HeaderEntry]  # tensor -> its header entry (dtype, shape, offsets)
    files: dict[str, str]  # tensor -> the file holding it, relative to the component directory
    metadata: dict[str, dict[str, str]]  # file -> its header's __metadata__
    index: str | None  # the index file's name when the weights are sharded, else None
    total_size: Any = None  # the index's metadata.total_size exactly as written (unchecked here)

    def headers(self) -> Headers:
        return {key: (entry.dtype, entry.shape) for key, entry in self.entries.items()}


def has_weights(component_dir: Path, weights_name: str) -> bool:
    """Whether either form of `weights_name` is present (a symlink counts: the reader refuses it by name)."""
    return any(_present(component_dir / name) for name in (weights_name, index_name(weights_name)))


def read_weights(component_dir: Path, weights_name: str, error: type[MergeflowError], what: str) -> StoredWeights:
    """Read and check the weights of one component; `what` names its owner in messages ("the base").

    Every header is read (a few KiB each), no tensor data: the answer costs milliseconds.
    """
    where = component_dir.name
    single, index = component_dir / weights_name, component_dir / index_name(weights_name)
    if _present(single) and _present(index):
        raise error(f"{where}/ holds both {single.name} and {index.name}; {what} must hold one of them "
                    "(loaders disagree on which one is read): remove the other")
    if _present(single):
        entries, metadata = _header(single, error, what)
        return StoredWeights(entries, {key: single.name for key in entries}, {single.name: metadata}, None)
    if not _present(index):
        raise error(f"{where}/ has no {single.name} nor {index.name}; {what} is incomplete")
    _refuse_symlink(index, error, what)
    data = read_json_strict(index, error, f"{where}/{index.name}")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise error(f"{where}/{index.name} has no weight_map")
    for file_name in weight_map.values():  # before any file is touched: a hostile name never reaches the disk
        check_relative_name(file_name, f"{where}/{index.name}")
    entries: dict[str, HeaderEntry] = {}
    metadata: dict[str, dict[str, str]] = {}
    for file_name in sorted(set(weight_map.values())):
        shard = component_dir / file_name
        _refuse_symlink(shard, error, what)
        if not shard.is_file():
            raise error(f"{where}/{index.name} names {file_name}, which is missing")
        shard_entries, metadata[file_name] = _header(shard, error, what)
        for key, entry in shard_entries.items():
            # Also refuses a tensor held by two shards: the index places it in one of them only.
            if weight_map.get(key) != file_name:
                raise error(f"{where}/{file_name} holds {key}, which {index.name} places elsewhere")
            entries[key] = entry
    missing = sorted(set(weight_map) - set(entries))
    if missing:
        raise error(f"{where}/{index.name} lists {missing[0]} but no shard holds it")
    index_metadata = data.get("metadata")
    total = index_metadata.get("total_size") if isinstance(index_metadata, dict) else None
    return StoredWeights(entries, dict(weight_map), metadata, index.name, total)


def read_weight_map(component_dir: Path, weights_name: str, error: type[MergeflowError], what: str) -> dict[str, str]:
    """Tensor name -> the file holding it (relative to `component_dir`), checked as `read_weights` does."""
    return read_weights(component_dir, weights_name, error, what).files


def read_weight_headers(component_dir: Path, weights_name: str, error: type[MergeflowError], what: str) -> Headers:
    """Tensor name -> (dtype, shape) from the headers, checked as `read_weights` does."""
    return read_weights(component_dir, weights_name, error, what).headers()


def read_stored_tensor(component_dir: Path, weights_name: str, key: str, error: type[MergeflowError],
                       what: str) -> torch.Tensor | None:
    """The values of one stored tensor (a base's own buffer, say), or None when the weights lack it."""
    file_name = read_weight_map(component_dir, weights_name, error, what).get(key)
    if file_name is None:
        return None
    from safetensors import safe_open

    with safe_open(str(component_dir / file_name), framework="pt") as handle:
        return handle.get_tensor(key)


def _present(path: Path) -> bool:
    return path.is_symlink() or path.is_file()


def _refuse_symlink(path: Path, error: type[MergeflowError], what: str) -> None:
    # A link could point anywhere and change under the export; the stamps and hashes would vouch
    # for the link, not for the bytes read.
    if path.is_symlink():
        raise error(f"{path.parent.name}/{path.name} of {what} is a symlink (a Hugging Face cache snapshot?); "
                    "use a plain copy: mergeflow never follows links")


def _header(path: Path, error: type[MergeflowError], what: str) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    _refuse_symlink(path, error, what)
    try:
        entries, metadata, _ = read_header(path)
    except ArtifactInvalidError as exc:
        if issubclass(error, ArtifactInvalidError):  # an artifact's own error already says what is wrong
            raise
        raise error(f"weights {path.parent.name}/{path.name} of {what} are damaged: {exc}") from None
    return entries, metadata
