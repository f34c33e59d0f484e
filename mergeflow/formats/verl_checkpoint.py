"""The verl checkpoint directory: fsdp_config.json, the exact rank-file set, LoRA metadata."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import CheckpointError
from mergeflow.io.jsonfiles import read_json_strict

RANK_FILE_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
STEP_DIR_RE = re.compile(r"global_step_(\d+)")  # verl's `global_step_N/actor` checkpoint directories
FSDP_CONFIG = "fsdp_config.json"
LORA_META = "lora_train_meta.json"


@dataclass(frozen=True)
class FsdpConfig:
    """fsdp_config.json as rank 0 wrote it."""

    version: int
    world_size: int


def _strict_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_fsdp_config(actor_dir: Path) -> FsdpConfig:
    """Parse fsdp_config.json strictly: an object with integer FSDP_version (1|2) and world_size >= 1."""
    data = read_json_strict(actor_dir / FSDP_CONFIG, CheckpointError, FSDP_CONFIG)
    if not isinstance(data, dict):
        raise CheckpointError(f"{FSDP_CONFIG} must be a JSON object like {{\"FSDP_version\": 2, \"world_size\": 4}}")
    for field in ("FSDP_version", "world_size"):
        if field not in data:
            raise CheckpointError(f"{FSDP_CONFIG} has no {field!r}; it must hold FSDP_version and world_size")
        if not _strict_int(data[field]):
            raise CheckpointError(f"{FSDP_CONFIG}: {field} must be an integer, got {data[field]!r}")
    if data["FSDP_version"] not in (1, 2):
        raise CheckpointError(f"{FSDP_CONFIG}: FSDP_version must be 1 or 2, got {data['FSDP_version']}")
    if data["world_size"] < 1:
        raise CheckpointError(f"{FSDP_CONFIG}: world_size must be >= 1, got {data['world_size']}")
    return FsdpConfig(version=data["FSDP_version"], world_size=data["world_size"])


def step_of(dir_name: str) -> int | None:
    """The N of a `global_step_N` directory name, or None for any other name."""
    match = STEP_DIR_RE.fullmatch(dir_name)
    return int(match.group(1)) if match else None


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


def rank_file_names(actor_dir: Path, world_size: int) -> list[str]:
    """The rank files for `world_size`, in rank order; any missing or stale file is an error."""
    if not actor_dir.is_dir():
        raise CheckpointError(f"--local_dir {actor_dir} is not a directory")
    expected = [rank_file_name(world_size, r) for r in range(world_size)]
    present = {p.name for p in actor_dir.iterdir() if RANK_FILE_RE.match(p.name)}
    missing = [name for name in expected if name not in present]
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise CheckpointError(
            f"{len(missing)} rank file(s) of world size {world_size} are missing ({shown}); "
            "the checkpoint is incomplete or still being written"
        )
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise CheckpointError(
            f"unexpected rank file(s) {', '.join(unexpected[:3])} for world size {world_size} "
            f"(stale files from another run?); remove them or fix {FSDP_CONFIG}"
        )
    for name in expected:
        path = actor_dir / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"rank file {name} is not a regular file")
    return expected
