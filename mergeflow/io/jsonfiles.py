"""Strict JSON reading (duplicate keys are an error) and durable JSON writing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mergeflow.errors import MergeflowError


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_json_strict(path: Path, error: type[MergeflowError], what: str) -> Any:
    """Parse `path` as JSON, raising `error` (one line, naming `what`) on any defect."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} is missing: expected {path.name} in {path.parent.name}/") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} cannot be read ({exc.__class__.__name__}: {exc})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None


def dumps_canonical(obj: Any, indent: int | None = 2) -> str:
    """Deterministic JSON text (sorted keys) with a trailing newline."""
    return json.dumps(obj, indent=indent, sort_keys=True) + "\n"


def write_json_durable(path: Path, obj: Any, *, indent: int | None = 2, sort_keys: bool = True) -> bytes:
    """Write JSON through a temp file, fsync and rename; returns the bytes written."""
    data = (json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode("utf-8")
    write_bytes_durable(path, data)
    return data


def write_bytes_durable(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file.

    `tmp` (same filesystem) keeps the half-written file out of the directory being built.
    """
    tmp = tmp or path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
