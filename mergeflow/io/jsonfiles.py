"""Strict JSON reading (duplicate keys are an error) and durable JSON writing."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from mergeflow.errors import MergeflowError
from mergeflow.io.os_errors import name_written_file
from mergeflow.io.session import active_session

# A JSON object at an edge, not yet given its shape: as parsed from a file or as an event's or a
# deployment's payload. Once read and checked, the code passes named shapes instead: ModelConfig
# and PipelineIndex (mergeflow.formats.model_config), ManifestDocument (mergeflow.formats.manifest),
# each command's TypedDict result; records (mergeflow.records) carry everything mergeflow decides itself.
JsonObject = dict[str, Any]

# Temporary files of durable writes carry this in their name, so a resume after a kill can tell
# them from the artifact's own files and remove them.
PARTIAL_MARKER = ".mergeflow-partial-"
_OLD_PARTIAL = re.compile(r"^\..+\.tmp-\d+$")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> JsonObject:
    out: JsonObject = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}; write each key once")
        out[key] = value
    return out


def read_json_strict(path: Path, error: type[MergeflowError], what: str) -> Any:
    """Parse `path` as JSON, raising `error` (one line, naming `what`) on any defect."""
    session = active_session()
    try:
        # Within an export each metadata file is read once: the pre-flight, the plan and the checks share its text.
        text = session.read_bytes(path).decode("utf-8") if session is not None else path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} is missing: expected {path.name} in {path.parent.name}/") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} cannot be read ({exc.__class__.__name__}: {exc})") from None
    return parse_json_strict(text, error, what)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def parse_json_strict(raw: str | bytes, error: type[MergeflowError], what: str, *, finite: bool = False) -> Any:
    """Parse JSON held in memory (a file's bytes, a header field), raising `error` naming `what` on any defect.

    The one strict rule of `read_json_strict`: a duplicate key is an error (Python would keep the
    last value silently, other readers may keep the first). Bytes must be UTF-8, as JSON requires.
    `finite=True` also refuses NaN and +-Infinity, which Python's json accepts but JSON has not:
    for files of numbers that must be real (LoRA hyper-parameters). Configs are read without it,
    because Diffusers itself writes -Infinity into real scheduler configs (`lambda_min_clipped`).
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant if finite else None)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a duplicate key, a non-finite constant
        raise error(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # thousands of nested brackets: no config is shaped like that
        raise error(f"{what} is nested too deeply to be a real config") from None


def dumps_canonical(obj: Any, indent: int | None = 2) -> str:
    """Deterministic JSON text (sorted keys) with a trailing newline."""
    return json.dumps(obj, indent=indent, sort_keys=True) + "\n"


def write_json_durable(path: Path, obj: Any, *, indent: int | None = 2, sort_keys: bool = True) -> bytes:
    """Write JSON through a temp file, fsync and rename; returns the bytes written."""
    data = (json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode("utf-8")
    write_bytes_durable(path, data)
    return data


def partial_name(path: Path) -> Path:
    """The temporary name `path` is written under before its rename (see `is_partial_write`)."""
    return path.with_name(f".{path.name}{PARTIAL_MARKER}{os.getpid()}")


def is_partial_write(name: str) -> bool:
    """A temporary file a killed writer left: ours (`.NAME.mergeflow-partial-PID`), or the old `.NAME.tmp-PID`."""
    return name.startswith(".") and (PARTIAL_MARKER in name or _OLD_PARTIAL.match(name) is not None)


def write_bytes_durable(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file.

    The bytes go to `tmp` (default: `partial_name(path)`, which a resume recognises and removes)
    and are fsynced before the rename; `tmp` elsewhere on the same filesystem keeps the
    half-written file out of the directory being built.
    """
    tmp = tmp or partial_name(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        name_written_file(exc, path)
        raise
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
