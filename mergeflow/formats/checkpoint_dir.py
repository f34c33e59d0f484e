"""Which checkpoint format a directory holds, and its files, from the listing alone (no torch import).

The command line's pre-flight runs this before Prefect, torch or diffusers load: verl's per-rank
files (fsdp_config.json + model_world_size_W_rank_R.pt) or a torch Distributed Checkpoint
(`.metadata` + `*.distcp`, as accelerate, VeOmni and torchtitan save).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from mergeflow.formats.verl_checkpoint import rank_file_names, read_fsdp_config
from mergeflow.formats.zip_records import sha256_and_check_records
from mergeflow.io.fs import sha256_file

METADATA = ".metadata"
SUFFIX = ".distcp"

# "verl": fsdp_config.json + one model_world_size_W_rank_R.pt per rank; "dcp": a torch DCP.
CheckpointFormat = Literal["verl", "dcp"]


def is_dcp_dir(path: Path) -> bool:
    """A finished DCP: `.metadata` beside at least one `*.distcp`."""
    return (path / METADATA).is_file() and any(path.glob(f"*{SUFFIX}"))


def not_a_dcp_dir(path: Path) -> str | None:
    """Why `path` is not a readable DCP directory, in words that say what each layout needs; None if it
    is one, or holds no DCP file at all."""
    has_metadata = (path / METADATA).exists()
    has_chunks = any(path.glob(f"*{SUFFIX}"))
    if has_metadata and has_chunks:
        return None
    if has_chunks:
        return (f"{path.name}/ is a DCP checkpoint without {METADATA}: the save did not finish (torch writes "
                f"{METADATA} last); wait for it or copy the checkpoint again")
    if has_metadata:
        return (f"{path.name}/ holds {METADATA} but no *{SUFFIX} file: a DCP checkpoint needs both; "
                "copy the whole directory")
    return None


def format_of(directory: Path) -> CheckpointFormat:
    """"dcp" for a finished torch Distributed Checkpoint, else "verl" (whose reader says what is wrong)."""
    return "dcp" if is_dcp_dir(directory) else "verl"


def dcp_files(directory: Path) -> tuple[str, ...]:
    """A DCP's files as the manifest lists them: `.metadata`, then every `.distcp` in name order."""
    return (METADATA, *sorted(p.name for p in directory.glob(f"*{SUFFIX}")))


def listed_files(directory: Path) -> list[Path]:
    """The files the manifest will hash (the pre-flight's prefetch); refuses a directory that is neither format."""
    if format_of(directory) == "dcp":
        return [directory / name for name in dcp_files(directory)]
    fsdp = read_fsdp_config(directory)
    return [directory / name for name in rank_file_names(directory, fsdp.world_size)]


def file_hasher(fmt: CheckpointFormat) -> Callable[[Path], str]:
    """How a checkpoint file is hashed: a verl rank file is one zip whose records' CRC-32s are checked in
    the same pass; a `.distcp` is many `torch.save` records back to back, each checked when its chunk is read."""
    return sha256_and_check_records if fmt == "verl" else sha256_file
