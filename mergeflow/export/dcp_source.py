"""A torch DCP checkpoint as a source of rank pieces for the export: key checks and verified tensors.

The format (mergeflow/formats/dcp.py) says where each chunk's bytes are; this module assembles
them through the same reconstruct path as verl's rank files, so there is one way to rebuild and
round-trip verify a tensor.
"""

from __future__ import annotations

import torch

from mergeflow.errors import SchemaMismatchError
from mergeflow.export.reconstruct import (
    check_coverage,
    global_pieces,
    verified_chunks,
    verify_round_trip,
)
from mergeflow.formats.dcp import DcpCheckpoint, DcpChunks


def check_keys(checkpoint: DcpCheckpoint, expected: dict[str, tuple[int, ...]]) -> None:
    """The DCP must hold exactly the base's tensors (after wrapper stripping), with the same shapes."""
    actual = {name: t.layout.shape for name, t in checkpoint.tensors.items()}
    if not set(actual) & set(expected):
        raise SchemaMismatchError(
            f"none of the {len(actual)} DCP keys names a tensor of the base (e.g. {', '.join(sorted(actual)[:2])} vs "
            f"{', '.join(sorted(expected)[:2])}); is this the right base, or a DCP of another model?")
    check_coverage(expected, actual)


def read_tensor(chunks: DcpChunks, name: str) -> torch.Tensor:
    """One global tensor, assembled by reconstruct's path and round-trip verified chunk by chunk."""
    layout = chunks.checkpoint.tensors[name].layout
    pieces = verified_chunks(layout, chunks)  # type: ignore[arg-type]  (duck-typed like RankStates)
    parts = list(global_pieces(layout, pieces, layout.dtype, name))
    written = parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]).view(layout.shape)
    verify_round_trip(layout, written, pieces, layout.dtype, name)
    return written
