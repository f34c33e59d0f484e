"""Which checkpoint format a directory holds, and its files, from the listing alone (no torch import).

The command line's pre-flight runs this before Prefect, torch or diffusers load: verl's per-rank
files (fsdp_config.json + model_world_size_W_rank_R.pt) or a torch Distributed Checkpoint
(`.metadata` + `*.distcp`, as accelerate, VeOmni and torchtitan save).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from mergeflow.formats.dcp_layout import dcp_files, is_dcp_dir
from mergeflow.formats.verl_checkpoint import rank_file_names, read_fsdp_config
from mergeflow.formats.zip_records import sha256_and_check_records

# "verl": fsdp_config.json + one model_world_size_W_rank_R.pt per rank; "dcp": a torch DCP.
CheckpointFormat = Literal["verl", "dcp"]


def format_of(directory: Path) -> CheckpointFormat:
    """"dcp" for a finished torch Distributed Checkpoint, else "verl" (whose reader says what is wrong)."""
    return "dcp" if is_dcp_dir(directory) else "verl"


def listed_files(directory: Path) -> list[Path]:
    """The files the manifest will hash (the pre-flight's prefetch); refuses a directory that is neither format."""
    if format_of(directory) == "dcp":
        return [directory / name for name in dcp_files(directory)]
    fsdp = read_fsdp_config(directory)
    return [directory / name for name in rank_file_names(directory, fsdp.world_size)]


def file_hasher(fmt: CheckpointFormat, trust_checkpoint: bool = False) -> Callable[[Path], str]:
    """How a checkpoint file is hashed, every record's CRC-32 checked in the same pass: a verl rank file is
    one zip; a `.distcp` is many `torch.save` zips back to back, found from `.metadata` (parsed as the export
    parses it, hence the trust flag)."""
    if fmt == "verl":
        return sha256_and_check_records
    # Imported here (torch), in the caller's thread: never first from the background hashing thread.
    from mergeflow.formats import dcp

    return dcp.sha256_and_check_distcp_trusted if trust_checkpoint else dcp.sha256_and_check_distcp
