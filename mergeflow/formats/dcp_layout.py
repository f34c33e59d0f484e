"""The files of a torch Distributed Checkpoint (DCP) directory, from the listing alone (no torch import).

torch's FileSystemWriter (torch/distributed/checkpoint/filesystem.py) writes one `__R_0.distcp`
per writing rank and, last, `.metadata`: a directory with `.distcp` files but no `.metadata` is a
save that did not finish.
"""

from __future__ import annotations

import stat
from pathlib import Path

from mergeflow.errors import CheckpointError

METADATA = ".metadata"
SUFFIX = ".distcp"
# The refusal of a DCP export with neither source of a model config (the pre-flight's and the plan's).
NO_MODEL_CONFIG = ("a DCP checkpoint carries no model config: pass a local --base_model (its transformer's "
                   "config.json is used) or --hf_model_config_path DIR (a directory holding the model's config.json)")


def is_dcp_dir(path: Path) -> bool:
    """A finished DCP: `.metadata` beside at least one `*.distcp` (whatever kind of file: reading it says what is wrong)."""
    return (path / METADATA).exists() and any(path.glob(f"*{SUFFIX}"))


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


def dcp_files(directory: Path) -> tuple[str, ...]:
    """A DCP's files as the manifest lists them: `.metadata`, then every `.distcp` in name order; each a regular file."""
    names = (METADATA, *sorted(p.name for p in directory.glob(f"*{SUFFIX}")))
    for name in names:
        regular_file(directory / name)
    return names


def regular_file(path: Path) -> Path:
    """`path` if it is a regular file (by stat, without opening it: opening a FIFO blocks, a device streams for ever)."""
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        raise CheckpointError(f"{path.name} in {path.parent.name}/ is not a regular file (a FIFO, socket, device or "
                              "directory); a DCP checkpoint holds only files: copy the checkpoint again")
    return path
