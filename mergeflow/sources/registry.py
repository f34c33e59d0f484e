"""The checkpoint sources mergeflow reads, in detection order, and the lookups the rest of the package uses.

Adding a kind is one module in this package and one row in `SOURCES` (docs/extending.md). A
directory is the first source whose `detect` says so; when none does, the fallback's reader
runs anyway, because its refusal says what the directory lacks (and where a checkpoint probably is).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import CheckpointError
from mergeflow.sources.base import (
    CheckpointSource,
    ModelConfigSource,
    OpenedCheckpoint,
    PieceSource,
)
from mergeflow.sources.dcp import DcpSource
from mergeflow.sources.verl import VerlSource

if TYPE_CHECKING:
    from mergeflow.config import ModelMergerConfig
    from mergeflow.records import CheckpointInputs

_VERL = VerlSource()
# Detection order: the most specific first (a finished DCP save is `.metadata` beside `*.distcp`).
SOURCES: tuple[CheckpointSource, ...] = (DcpSource(), _VERL)
# What a directory no source recognises is read as: verl's reader names the missing fsdp_config.json,
# an unfinished DCP save, or the global_step_N/actor directory the user probably meant.
FALLBACK: CheckpointSource = _VERL

_BY_KIND = {source.kind: source for source in SOURCES}
assert len(_BY_KIND) == len(SOURCES), "two sources share a kind"


def source_for(directory: Path) -> CheckpointSource:
    """The source that reads `directory`, from its listing alone (no file opened, no torch import)."""
    return next((source for source in SOURCES if source.detect(directory)), FALLBACK)


def source_named(kind: str) -> CheckpointSource:
    """The source a plan recorded (`CheckpointInputs.format`)."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise CheckpointError(f"unknown checkpoint kind {kind!r}; mergeflow reads {', '.join(_BY_KIND)}") from None


def listed_files(directory: Path) -> list[Path]:
    """The files the manifest will hash (the pre-flight's prefetch); refuses a directory that is no checkpoint."""
    return source_for(directory).listed_files(directory)


def file_hasher(kind: str, trust_checkpoint: bool = False) -> Callable[[Path], str]:
    """How a file of a `kind` checkpoint is hashed, every record's CRC-32 checked in the same pass."""
    return source_named(kind).file_hasher(trust_checkpoint)


def open_checkpoint(directory: Path, *, trust_checkpoint: bool = False) -> OpenedCheckpoint:
    """Open a checkpoint directory's metadata (verl's rank 0, a DCP's `.metadata`), refusing what is not one."""
    return source_for(directory).open(directory, trust_checkpoint=trust_checkpoint)


def model_config_source(config: ModelMergerConfig, kind: str, config_dir: Path, base: Path | None) -> ModelConfigSource:
    """The model config a `kind` checkpoint is exported with, and how the manifest names it."""
    return source_named(kind).model_config_source(config, config_dir, base)


def open_pieces(checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> PieceSource:
    """The reader of a planned checkpoint's pieces: rank files (mmap) or DCP chunks (their byte ranges)."""
    return source_named(checkpoint.format).open_pieces(checkpoint, trust_checkpoint=trust_checkpoint)
