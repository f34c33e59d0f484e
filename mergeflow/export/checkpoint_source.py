"""The training checkpoint, whichever format it is: verl's per-rank files or a torch DCP.

Everything downstream of planning works on `TensorLayout`s and a `PieceSource`; this module is the
one place that knows which format a directory holds and answers, for both:

- which files it consists of (hashed into the manifest's `source_files`; how: checkpoint_dir.file_hasher);
- the keys it holds (LoRA detection) and where the model config comes from: verl saves
  `huggingface/config.json`, a DCP carries none, so --hf_model_config_path or the base's;
- the reader of its pieces, and forgetting cached readers once an export is over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mergeflow.architectures.registry import detect_base
from mergeflow.config import ModelMergerConfig
from mergeflow.errors import BaseModelError, CheckpointError, UsageError
from mergeflow.export.dcp_source import DcpSources
from mergeflow.export.reconstruct import PieceSource, RankStates
from mergeflow.formats.checkpoint_dir import CheckpointFormat, format_of
from mergeflow.formats.dcp_layout import NO_MODEL_CONFIG
from mergeflow.formats.manifest import (
    BASE_CONFIG_PREFIX,
    FLAG_CONFIG_PATH,
    VERL_CONFIG_PATH,
)
from mergeflow.formats.verl_checkpoint import (
    FSDP_CONFIG,
    rank_file_names,
    read_fsdp_config,
)
from mergeflow.records import CheckpointInputs


@dataclass(frozen=True)
class OpenedCheckpoint:
    """What planning needs of a checkpoint: its files, shape and keys, read from metadata only."""

    format: CheckpointFormat
    directory: Path
    files: tuple[str, ...]  # hashed into source_files: rank files, or .metadata and every .distcp
    world_size: int
    fsdp_version: int  # 0: a DCP does not record it
    keys: tuple[str, ...]  # tensor names as the LoRA rules read them (a DCP's with wrapper prefixes removed)
    marker_files: tuple[str, ...]  # small files stamped beside the rank files (fsdp_config.json)


def open_checkpoint(directory: Path, *, trust_checkpoint: bool = False) -> OpenedCheckpoint:
    """Open a checkpoint directory's metadata (rank 0's pickle, or `.metadata`), refusing what is not one."""
    if format_of(directory) == "dcp":
        parsed = DcpSources.chunks(directory, trust_checkpoint=trust_checkpoint).checkpoint
        return OpenedCheckpoint("dcp", directory, parsed.files, len(parsed.files) - 1, 0, tuple(parsed.tensors), ())
    fsdp = read_fsdp_config(directory)
    names = tuple(rank_file_names(directory, fsdp.world_size))
    # mmap: unpickling the key list costs no private memory; every rank's keys are compared later.
    # Through the shared cache, so load-rank-00000 reuses the parsed file.
    keys = tuple(RankStates(directory, names[:1], trust_checkpoint=trust_checkpoint).state(0))
    return OpenedCheckpoint("verl", directory, names, fsdp.world_size, fsdp.version, keys, (FSDP_CONFIG,))


@dataclass(frozen=True)
class ModelConfigSource:
    """The model config an export is planned with, and how the manifest names it."""

    path: Path
    logical_path: str  # source_model_config.logical_path: no local path
    what: str  # how messages name it
    error: type[CheckpointError] | type[BaseModelError]


def model_config_source(config: ModelMergerConfig, fmt: CheckpointFormat, config_dir: Path,
                        base: Path | None) -> ModelConfigSource:
    """verl: the checkpoint's own config (or --hf_model_config_path's). DCP: the flag's, else the base transformer's."""
    if fmt == "verl":
        return ModelConfigSource(config_dir / "config.json", VERL_CONFIG_PATH,
                                 "huggingface/config.json of the checkpoint", CheckpointError)
    if config.model_config_given():
        return ModelConfigSource(config_dir / "config.json", FLAG_CONFIG_PATH,
                                 "config.json of --hf_model_config_path", CheckpointError)
    if base is None:
        raise UsageError(NO_MODEL_CONFIG)
    path = detect_base(base, config.component).transformer_dir / "config.json"
    relative = path.relative_to(base).as_posix()
    return ModelConfigSource(path, BASE_CONFIG_PREFIX + relative, f"{relative} of the base", BaseModelError)


def open_pieces(checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> PieceSource:
    """The reader of a planned checkpoint's pieces: rank files (mmap) or DCP chunks (their byte ranges)."""
    directory = Path(checkpoint.actor_dir)
    if checkpoint.format == "dcp":
        return DcpSources.chunks(directory, trust_checkpoint=trust_checkpoint)
    return RankStates(directory, checkpoint.rank_files, trust_checkpoint=trust_checkpoint)


def forget(directory: Path) -> None:
    """Drop what this process keeps of a checkpoint (mappings, parsed metadata) once its export is over."""
    RankStates.forget(directory)
    DcpSources.forget(directory)
