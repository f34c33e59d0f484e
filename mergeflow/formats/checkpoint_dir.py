"""Which checkpoint format a directory holds, and its files, from the listing alone (no torch import).

The command line's pre-flight runs this before Prefect, torch or diffusers load: verl's per-rank
files (fsdp_config.json + model_world_size_W_rank_R.pt) or a torch Distributed Checkpoint
(`.metadata` + `*.distcp`, as accelerate, VeOmni and torchtitan save).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from mergeflow.errors import CheckpointError
from mergeflow.formats.dcp_layout import dcp_files, is_dcp_dir
from mergeflow.formats.verl_checkpoint import rank_file_names, read_fsdp_config, step_of
from mergeflow.formats.zip_records import sha256_and_check_records

# "verl": fsdp_config.json + one model_world_size_W_rank_R.pt per rank; "dcp": a torch DCP.
CheckpointFormat = Literal["verl", "dcp"]


def format_of(directory: Path) -> CheckpointFormat:
    """"dcp" for a finished torch Distributed Checkpoint, else "verl" (whose reader says what is wrong)."""
    return "dcp" if is_dcp_dir(directory) else "verl"


def require_local_dir(actor: Path) -> None:
    """Refuse a --local_dir that is not a directory; a missing one names the run's nearest checkpoints.

    A typo in the step (global_step_70 where the run saved 60 and 80) is the usual cause, so the
    message lists the existing `global_step_N/actor` directories nearest to the step asked for.
    """
    if actor.is_dir():
        return
    if actor.exists():
        raise CheckpointError(f"--local_dir {actor} is not a directory")
    nearest = nearest_checkpoints(actor)
    hint = f"; the nearest checkpoints of that run: {', '.join(map(str, nearest))}" if nearest else ""
    raise CheckpointError(f"--local_dir {actor} does not exist{hint}")


def nearest_checkpoints(missing: Path, count: int = 3) -> list[Path]:
    """The existing checkpoint directories of the training run `missing` points into, nearest step first.

    The run is the parent of the path's `global_step_N` part, else the nearest existing ancestor.
    Each result is the directory to pass: `global_step_M/actor` where verl saved one, else `global_step_M`.
    """
    wanted = next((step for step in map(step_of, reversed(missing.parts)) if step is not None), None)
    run = next((p.parent for p in (missing, *missing.parents) if step_of(p.name) is not None), None)
    if run is None:
        run = next((p for p in missing.parents if p.is_dir()), None)
    if run is None or not run.is_dir():
        return []
    try:
        steps = [(n, p) for p in run.iterdir() if (n := step_of(p.name)) is not None and p.is_dir()]
    except OSError:  # an unreadable run directory: no hint rather than a second error
        return []
    # Nearest to the step asked for (the later one on a tie); without one, the latest.
    steps.sort(key=lambda item: (abs(item[0] - wanted), -item[0]) if wanted is not None else -item[0])
    return [p / "actor" if (p / "actor").is_dir() else p for _, p in steps[:count]]


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
