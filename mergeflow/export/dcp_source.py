"""A torch DCP checkpoint as a source of rank pieces for the export: layouts, key checks, verified tensors.

The format (mergeflow/formats/dcp.py) says where each chunk's bytes are; this module turns its
chunks into `TensorLayout`s (chunk c plays rank c) and assembles them through the same
reconstruct path as verl's rank files, so there is one way to rebuild and round-trip verify a tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mergeflow.errors import SchemaMismatchError
from mergeflow.export.reconstruct import (
    check_coverage,
    global_pieces,
    verified_chunks,
    verify_round_trip,
)
from mergeflow.formats.dcp import (
    METADATA,
    DcpCheckpoint,
    DcpChunks,
    DcpTensor,
    forget_parsed,
    parsed_dcp,
)
from mergeflow.io.fs import FileStamp
from mergeflow.io.stamped_cache import StampedCache
from mergeflow.records import TensorLayout


def tensor_layout(tensor: DcpTensor) -> TensorLayout:
    """The chunks of one DCP tensor as a TensorLayout: chunk c is "rank" c, with no replicas."""
    return TensorLayout(tensor.key, tensor.dtype, tensor.shape, tensor.shard_dim,
                        tuple((c,) for c in range(len(tensor.chunks))), tensor.chunk_shapes)


def dcp_layouts(checkpoint: DcpCheckpoint) -> dict[str, TensorLayout]:
    """Every tensor's layout by its Diffusers name (what verl's `rank_layouts` gives per raw key)."""
    return {name: tensor_layout(tensor) for name, tensor in sorted(checkpoint.tensors.items())}


class DcpSources:
    """Parsed DCP checkpoints shared by the tasks of one process, keyed by the `.metadata` stamp:
    `.metadata` is parsed once per export (formats.dcp.parsed_dcp, shared with the hash pass that
    CRC-checks the `.distcp` records) instead of once per shard task."""

    _cache: StampedCache[DcpChunks] = StampedCache(capacity=8)

    @classmethod
    def chunks(cls, directory: Path, *, trust_checkpoint: bool = False) -> DcpChunks:
        stamp = FileStamp.of(directory / METADATA)
        return cls._cache.get_or_load((str(directory), stamp, trust_checkpoint),
                                      lambda: DcpChunks(parsed_dcp(directory, trust_checkpoint=trust_checkpoint)))

    @classmethod
    def forget(cls, directory: Path) -> None:
        """Drop a checkpoint's parsed metadata once its export is over (a long-running `serve`)."""
        cls._cache.forget(lambda path: path == str(directory))
        forget_parsed(directory)


def check_keys(checkpoint: DcpCheckpoint, expected: dict[str, tuple[int, ...]]) -> None:
    """The DCP must hold exactly the base's tensors (after wrapper stripping), with the same shapes."""
    actual = {name: t.shape for name, t in checkpoint.tensors.items()}
    if not set(actual) & set(expected):
        raise SchemaMismatchError(
            f"none of the {len(actual)} DCP keys names a tensor of the base (e.g. {', '.join(sorted(actual)[:2])} vs "
            f"{', '.join(sorted(expected)[:2])}); is this the right base, or a DCP of another model?")
    check_coverage(expected, actual)


def read_tensor(chunks: DcpChunks, name: str) -> torch.Tensor:
    """One global tensor, assembled by reconstruct's path and round-trip verified chunk by chunk."""
    layout = tensor_layout(chunks.checkpoint.tensors[name])
    pieces = verified_chunks(layout, chunks)
    parts = list(global_pieces(layout, pieces, layout.dtype, name))
    written = parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]).view(layout.shape)
    verify_round_trip(layout, written, pieces, layout.dtype, name)
    return written
