"""The verl checkpoint directory: fsdp_config.json, the exact rank-file set, LoRA metadata."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import CheckpointError
from mergeflow.formats.dcp_layout import not_a_dcp_dir
from mergeflow.io.jsonfiles import read_json_strict

RANK_FILE_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
STEP_DIR_RE = re.compile(r"global_step_(\d+)")  # verl's `global_step_N/actor` checkpoint directories
FSDP_CONFIG = "fsdp_config.json"
# Far beyond any training run (the largest have some 100,000 GPUs). Only a cheap early refusal of a
# damaged fsdp_config.json: nothing mergeflow does grows with world_size before it is checked
# against the rank files present.
MAX_WORLD_SIZE = 1 << 20
LORA_META = "lora_train_meta.json"


@dataclass(frozen=True)
class FsdpConfig:
    """fsdp_config.json as rank 0 wrote it."""

    version: int
    world_size: int


def _strict_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _not_a_checkpoint_dir(actor_dir: Path) -> str | None:
    """Why `actor_dir` is not verl's `global_step_N/actor`, in words that say where it probably is; None if it may be."""
    if not actor_dir.exists():
        return f"--local_dir {actor_dir} does not exist"
    if not actor_dir.is_dir():
        return f"--local_dir {actor_dir} is not a directory"
    if (actor_dir / FSDP_CONFIG).exists():
        return None
    if (actor_dir / "actor" / FSDP_CONFIG).is_file():
        return (f"{actor_dir.name}/ holds no {FSDP_CONFIG}, its actor/ does: pass --local_dir {actor_dir / 'actor'} "
                "(verl saves the model under global_step_N/actor)")
    steps = sorted((p for p in actor_dir.glob("global_step_*") if step_of(p.name) is not None and (p / "actor").is_dir()),
                   key=lambda p: step_of(p.name) or 0)
    if steps:
        return (f"{actor_dir.name}/ is a training run's output ({len(steps)} checkpoint(s)), not one checkpoint: pass "
                f"--local_dir {steps[-1] / 'actor'} (the latest), or watch/backfill the run")
    unfinished = not_a_dcp_dir(actor_dir)
    if unfinished:
        return unfinished
    if (actor_dir / ".metadata").exists() or any(actor_dir.glob("*.distcp")):
        # `merge`, `inspect` and `test` read a DCP directly; only the watcher and backfill look for verl's files.
        return (f"{actor_dir.name}/ is a torch Distributed Checkpoint (.metadata + *.distcp, as accelerate writes), "
                f"not verl's per-rank files ({FSDP_CONFIG} + model_world_size_W_rank_R.pt): `mergeflow merge` "
                "reads it as it is; the watcher and backfill follow verl's global_step_N/actor directories only")
    return (f"{FSDP_CONFIG} is missing in {actor_dir.name}/: --local_dir must be verl's global_step_N/actor directory "
            f"({FSDP_CONFIG}, huggingface/ and model_world_size_W_rank_R.pt files)")


def read_fsdp_config(actor_dir: Path) -> FsdpConfig:
    """Parse fsdp_config.json strictly: an object with integer FSDP_version (1|2) and 1 <= world_size <= MAX_WORLD_SIZE."""
    problem = _not_a_checkpoint_dir(actor_dir)
    if problem:
        raise CheckpointError(problem)
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
    if data["world_size"] > MAX_WORLD_SIZE:
        raise CheckpointError(f"{FSDP_CONFIG}: world_size {data['world_size']} is beyond any real run (at most "
                              f"{MAX_WORLD_SIZE:,} ranks); the file is damaged: copy it again from the training run")
    return FsdpConfig(version=data["FSDP_version"], world_size=data["world_size"])


def step_of(dir_name: str) -> int | None:
    """The N of a `global_step_N` directory name, or None for any other name."""
    match = STEP_DIR_RE.fullmatch(dir_name)
    return int(match.group(1)) if match else None


def verl_run_step(path: Path) -> tuple[str, int] | None:
    """(run, N) for a path laid out as verl saves it: `<run>/global_step_N` or `<run>/global_step_N/actor`."""
    step_dir = path.parent if path.name == "actor" else path
    step = step_of(step_dir.name)
    run = step_dir.parent.name
    return (run, step) if step is not None and run else None


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


def rank_file_names(actor_dir: Path, world_size: int) -> list[str]:
    """The rank files for `world_size`, in rank order; any missing or stale file is an error.

    Work and memory follow the files actually present, never `world_size` (an input): a
    world size larger than the directory's rank-file count is reported as missing files
    from the names that are there.
    """
    if not actor_dir.is_dir():
        raise CheckpointError(f"--local_dir {actor_dir} is not a directory")
    present = {p.name for p in actor_dir.iterdir() if RANK_FILE_RE.match(p.name)}
    found = {name for name in present if _is_rank_file_of(name, world_size)}
    if len(found) < world_size:
        missing = world_size - len(found)
        shown = ", ".join(_first_missing(found, world_size, 3)) + (" ..." if missing > 3 else "")
        raise CheckpointError(
            f"{missing} rank file(s) of world size {world_size} are missing ({shown}); "
            "the checkpoint is incomplete or still being written"
        )
    unexpected = sorted(present - found)
    if unexpected:
        raise CheckpointError(
            f"unexpected rank file(s) {', '.join(unexpected[:3])} for world size {world_size} "
            f"(stale files from another run?); remove them or fix {FSDP_CONFIG}"
        )
    expected = [rank_file_name(world_size, r) for r in range(world_size)]  # world_size == len(found) here
    for name in expected:
        path = actor_dir / name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"rank file {name} is not a regular file")
    return expected


def _first_missing(found: set[str], world_size: int, limit: int) -> list[str]:
    """The first `limit` rank-file names of `world_size` not in `found`: at most len(found) + limit probes."""
    missing: list[str] = []
    rank = 0
    while len(missing) < limit and rank < world_size:
        name = rank_file_name(world_size, rank)
        if name not in found:
            missing.append(name)
        rank += 1
    return missing


def _is_rank_file_of(name: str, world_size: int) -> bool:
    """`name` is exactly the canonical name of one rank of `world_size` (no leading zeros)."""
    match = RANK_FILE_RE.match(name)
    if match is None or int(match.group(1)) != world_size:
        return False
    rank = int(match.group(2))
    return rank < world_size and name == rank_file_name(world_size, rank)
