"""Opening one rank file safely and describing its tensors without reading their data."""

from __future__ import annotations

import logging
import math
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergeflow.errors import CheckpointError, ShardLayoutError, UnsafeCheckpointError
from mergeflow.formats import rank_pickle
from mergeflow.formats.rank_pickle import NotFastReadable, ShardedValue, StateDict

# Mesh dimensions that mean tensor/context/expert/pipeline parallelism: their shards are not
# torch.chunk pieces of one global tensor along a single dimension.
_NON_DATA_PARALLEL_DIMS = {"tp", "tensor", "cp", "context", "ep", "expert", "pp", "pipeline"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_rank_state(path: Path, *, trust_checkpoint: bool = False) -> StateDict:
    """Load a rank file safely (mmap); full unpickling only if trusted.

    The closed fast reader (`rank_pickle`) reads standard DTensor files; anything it does not
    know goes to torch's safe loader (weights_only), whose verdict and messages then apply.
    """
    try:
        state = rank_pickle.read_rank_file(path)
    except NotFastReadable:
        state = _load_safe(path, trust_checkpoint)
    for key in state:
        if not isinstance(key, str):
            raise CheckpointError(f"rank file {path.name} has a non-string key {key!r}")
    return state


def _load_safe(path: Path, trust_checkpoint: bool) -> StateDict:
    """torch's own safe loader (mmap, weights_only); full unpickling only if trusted."""
    import torch.distributed.tensor  # noqa: F401  (registers DTensor as a safe global for weights_only)

    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        _refuse_if_damaged(path, exc)
        if "weights only" not in str(exc).lower() and "weights_only" not in str(exc).lower():
            raise CheckpointError(f"rank file {path.name} is damaged ({_first_line(exc)}); "
                                  "copy it again from the training run") from None
        unknown = unknown_global(exc)
        if unknown is not None:  # random damage reads as a global nobody could have saved
            raise CheckpointError(f"rank file {path.name} is damaged: its pickle names {unknown}, which does not "
                                  "exist here; copy it again from the training run") from None
        if not trust_checkpoint:
            raise UnsafeCheckpointError(
                f"rank file {path.name} holds objects the safe loader refuses ({_first_line(exc)}); "
                "loading it would run arbitrary code. Pass --trust-checkpoint only if you trust its origin"
            ) from None
        state = _load_trusted(path)
    except (RuntimeError, EOFError, ValueError, OSError, IndexError, KeyError) as exc:
        _refuse_if_damaged(path, exc)
        raise CheckpointError(f"rank file {path.name} is truncated or damaged ({_first_line(exc)}); "
                              "copy it again from the training run") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"rank file {path.name} holds a {type(state).__name__}, not a state dict")
    return state


def damage_of(path: Path) -> str | None:
    """Why a rank file is damaged, if its container says so: torch.save writes a zip archive that
    stores a CRC-32 of every record. Read only on a refusal path (it reads the whole file)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile as exc:
        return f"it is not a readable torch.save archive ({exc})"
    except (OSError, EOFError, ValueError) as exc:
        return f"its archive cannot be read ({type(exc).__name__}: {exc})"
    if bad is not None:
        return f"record {bad} fails its CRC-32 check"
    return None


_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)\.([A-Za-z_]\w*)")


def unknown_global(exc: BaseException) -> str | None:
    """The refused `module.name` when no such module exists here: random damage, not a payload."""
    import importlib.util

    match = _GLOBAL.search(str(exc))
    if match is None:
        return None
    module = match.group(1)
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None  # top level only: nothing is imported
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module}.{match.group(2)}"


def _refuse_if_damaged(path: Path, exc: BaseException) -> None:
    damage = damage_of(path)
    if damage is not None:
        raise CheckpointError(f"rank file {path.name} is damaged: {damage}; copy it again from the training run "
                              f"(the loader said {_first_line(exc)})") from None


def _load_trusted(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:  # a trusted but broken pickle still gets one clear line
        raise CheckpointError(f"rank file {path.name} could not be loaded even with --trust-checkpoint ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


@dataclass(frozen=True)
class TensorEntry:
    """One key of one rank file, described from metadata only."""

    kind: str  # "dtensor" | "plain"
    dtype: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: tuple[str, ...]  # "R" for Replicate, "S<d>" for Shard(d); empty for plain tensors
    mesh_shape: tuple[int, ...]
    storage_id: tuple[int, int, tuple[int, ...], tuple[int, ...]]  # ties share these


def _placement_code(placement: object, key: str, file_name: str) -> str:
    # _StridedShard subclasses Shard, so only the exact types count as plain FSDP layouts;
    # both the fast reader's records and torch's own classes (a file torch's loader read).
    kind = type(placement)
    if kind is rank_pickle.Shard or (kind.__name__ == "Shard" and kind.__module__ == _TORCH_PLACEMENTS):
        return f"S{placement.dim}"  # type: ignore[attr-defined]
    if kind is rank_pickle.Replicate or (kind.__name__ == "Replicate" and kind.__module__ == _TORCH_PLACEMENTS):
        return "R"
    raise ShardLayoutError(
        f"{key} in {file_name} has placement {placement!r}; only Shard(d) and Replicate() "
        "(FSDP / HSDP) can be reassembled"
    )


_TORCH_PLACEMENTS = "torch.distributed.tensor.placement_types"


def is_dtensor(value: Any) -> bool:
    """A sharded value: the fast reader's record, or a real DTensor (only imported if one was loaded)."""
    if isinstance(value, ShardedValue):
        return True
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _mesh_shape(value: Any, key: str, file_name: str) -> tuple[int, ...]:
    mesh = value.device_mesh
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    bad = [n for n in names if n and n.lower() in _NON_DATA_PARALLEL_DIMS]
    if bad:
        raise ShardLayoutError(
            f"{key} in {file_name} lives on a mesh with {', '.join(bad)} dimensions (tensor/context/"
            "pipeline parallelism); only FSDP and HSDP checkpoints are supported"
        )
    try:
        shape = tuple(int(s) for s in mesh.shape)
    except Exception:  # DeviceMesh internals move between torch versions
        if len(value.placements) == 1:
            return ()
        raise ShardLayoutError(f"{key} in {file_name}: cannot read the device mesh shape of a multi-dimensional mesh") from None
    if len(shape) != len(value.placements):
        raise ShardLayoutError(f"{key} in {file_name}: mesh has {len(shape)} dims but {len(value.placements)} placements")
    return shape


def describe_state(state: StateDict, file_name: str) -> dict[str, TensorEntry]:
    """Metadata of every tensor in a loaded rank file; refuses values that are not tensors."""
    entries: dict[str, TensorEntry] = {}
    for key, value in state.items():
        if is_dtensor(value):
            placements = tuple(_placement_code(p, key, file_name) for p in value.placements)
            local = value.to_local()
            entries[key] = TensorEntry(
                kind="dtensor",
                dtype=dtype_name(value.dtype),
                global_shape=tuple(value.shape),
                local_shape=tuple(local.shape),
                placements=placements,
                mesh_shape=_mesh_shape(value, key, file_name),
                storage_id=_storage_id(local),
            )
            if local.dtype != value.dtype:
                raise CheckpointError(f"{key} in {file_name}: local shard dtype {local.dtype} differs from {value.dtype}")
        elif isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise CheckpointError(
                    f"{key} in {file_name} is a {type(value).__name__}; only DTensor and plain tensors are supported "
                    "(FSDP1 ShardedTensor checkpoints need a device mesh)"
                )
            entries[key] = TensorEntry(
                kind="plain",
                dtype=dtype_name(value.dtype),
                global_shape=tuple(value.shape),
                local_shape=tuple(value.shape),
                placements=(),
                mesh_shape=(),
                storage_id=_storage_id(value),
            )
        else:
            raise CheckpointError(f"{key} in {file_name} is a {type(value).__name__}, not a tensor")
    return entries


def _storage_id(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    if tensor.numel() == 0:
        return (0, 0, tuple(tensor.shape), tuple(tensor.stride()))
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def local_tensor(value: Any) -> torch.Tensor:
    """The rank-local data of a state-dict value (DTensor or plain)."""
    return value.to_local() if is_dtensor(value) else value


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
