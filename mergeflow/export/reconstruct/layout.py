"""How each global tensor is spread over the rank files, checked with torch.chunk arithmetic."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from mergeflow.errors import CheckpointError, ShardLayoutError
from mergeflow.formats.rank_files import TensorEntry
from mergeflow.records import RankIndex, TensorLayout


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Per-rank lengths that torch.chunk + FSDP padding give: ceil(n/parts) each, trailing short or empty."""
    chunk = -(-n // parts) if n else 0
    return [max(0, min(chunk, n - i * chunk)) for i in range(parts)]


def _coordinates(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(mesh_shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def plan_layouts(entries_by_rank: list[dict[str, TensorEntry]]) -> dict[str, TensorLayout]:
    """Combine every rank's metadata into one layout per key, refusing anything inconsistent."""
    world = len(entries_by_rank)
    keys0 = set(entries_by_rank[0])
    for rank, entries in enumerate(entries_by_rank[1:], start=1):
        if set(entries) != keys0:
            only0 = sorted(keys0 - set(entries))[:3]
            onlyr = sorted(set(entries) - keys0)[:3]
            raise CheckpointError(
                f"rank 0 and rank {rank} hold different key sets (only in rank 0: {only0}, only in rank {rank}: {onlyr}); "
                "the rank files come from different saves"
            )
    layouts = {key: _layout_for(key, [e[key] for e in entries_by_rank], world) for key in sorted(keys0)}
    return _mark_ties(layouts, entries_by_rank[0])


def rank_layouts(indexes: list[RankIndex]) -> dict[str, TensorLayout]:
    """`plan_layouts` of the rank indexes, in rank order whatever order they finished in."""
    return plan_layouts([ix.entries for ix in sorted(indexes, key=lambda ix: ix.rank)])


def _layout_for(key: str, per_rank: list[TensorEntry], world: int) -> TensorLayout:
    kinds = {e.kind for e in per_rank}
    if len(kinds) > 1:
        raise CheckpointError(f"{key} is a DTensor on some ranks and a plain tensor on others; the checkpoint is inconsistent")
    dtypes = {e.dtype for e in per_rank}
    if len(dtypes) > 1:
        raise CheckpointError(f"{key} has different dtypes across ranks ({', '.join(sorted(dtypes))})")
    first = per_rank[0]
    if any(e.global_shape != first.global_shape for e in per_rank):
        if first.kind == "plain":
            raise CheckpointError(f"{key} is a plain tensor with different shapes across ranks: it is not a full replica")
        raise ShardLayoutError(f"{key} has different global shapes across ranks")
    if first.kind == "plain":
        return TensorLayout(key, first.dtype, first.global_shape, None, (tuple(range(world)),), (first.global_shape,))
    if any(e.placements != first.placements or e.mesh_shape != first.mesh_shape for e in per_rank):
        raise ShardLayoutError(f"{key} has different placements or meshes across ranks")
    mesh_shape = first.mesh_shape or (world,)
    if any(not isinstance(size, int) or size < 1 for size in mesh_shape) or math.prod(mesh_shape) != world:
        raise ShardLayoutError(f"{key}: device mesh {mesh_shape} does not match world size {world}")
    shard_axes = [i for i, p in enumerate(first.placements) if p.startswith("S")]
    if len(shard_axes) > 1:
        raise ShardLayoutError(f"{key} is sharded on {len(shard_axes)} mesh dimensions (tensor parallel?); only FSDP/HSDP layouts are supported")
    shape = first.global_shape
    if not shard_axes:
        _check_local_shapes(key, per_rank, [shape] * world)
        return TensorLayout(key, first.dtype, shape, None, (tuple(range(world)),), (shape,))
    axis = shard_axes[0]
    dim = int(first.placements[axis][1:])
    if dim < 0 or dim >= len(shape):
        raise ShardLayoutError(f"{key}: Shard({dim}) is out of range for a tensor of shape {list(shape)}")
    parts = mesh_shape[axis]
    sizes = chunk_sizes(shape[dim], parts)
    groups: list[list[int]] = [[] for _ in range(parts)]
    expected: list[tuple[int, ...]] = []
    for rank in range(world):
        chunk = _coordinates(rank, mesh_shape)[axis]
        groups[chunk].append(rank)
        expected.append(shape[:dim] + (sizes[chunk],) + shape[dim + 1 :])
    _check_local_shapes(key, per_rank, expected)
    chunk_shapes = tuple(shape[:dim] + (s,) + shape[dim + 1 :] for s in sizes)
    return TensorLayout(key, first.dtype, shape, dim, tuple(tuple(g) for g in groups), chunk_shapes)


def _check_local_shapes(key: str, per_rank: list[TensorEntry], expected: list[tuple[int, ...]]) -> None:
    for rank, (entry, want) in enumerate(zip(per_rank, expected)):
        if entry.local_shape != want:
            raise ShardLayoutError(
                f"{key}: rank {rank} holds a local shard of shape {list(entry.local_shape)} but torch.chunk of "
                f"{list(entry.global_shape)} gives {list(want)}; the shards do not add up"
            )


def _mark_ties(layouts: dict[str, TensorLayout], rank0: dict[str, TensorEntry]) -> dict[str, TensorLayout]:
    by_storage: dict[tuple, list[str]] = {}
    for key, entry in rank0.items():
        if entry.storage_id[0] != 0:
            by_storage.setdefault(entry.storage_id, []).append(key)
    for keys in by_storage.values():
        if len(keys) < 2:
            continue
        keys.sort()
        for other in keys[1:]:
            layouts[other] = replace(layouts[other], tied_to=keys[0])
    return layouts


def replica_pairs(layout: TensorLayout) -> list[tuple[int, int]]:
    """(primary, replica) rank pairs whose chunk bytes must be equal."""
    return list(itertools.chain.from_iterable(((g[0], r) for r in g[1:]) for g in layout.chunk_ranks))
