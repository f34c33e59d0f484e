"""Path rules: relative names that cannot escape, inputs that do not overlap, staging names."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

from mergeflow.errors import PathSafetyError

STAGING_MARKER = ".mergeflow-staging-"
LOCK_SUFFIX = ".mergeflow.lock"


def check_relative_name(name: str, what: str) -> str:
    """Accept only a plain relative POSIX path (no absolute, '..', backslash, empty part)."""
    if not isinstance(name, str) or not name:
        raise PathSafetyError(f"{what}: empty or non-string file name {name!r}")
    if "\\" in name or "\x00" in name:
        raise PathSafetyError(f"{what}: file name {name!r} contains a backslash or NUL")
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith("/"):
        raise PathSafetyError(f"{what}: file name {name!r} is absolute")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise PathSafetyError(f"{what}: file name {name!r} contains '..', '.' or an empty part")
    return name


def _within(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_no_overlap(named: dict[str, Path]) -> None:
    """No two of the given directories may be equal or nested in one another."""
    items = [(label, path.resolve()) for label, path in named.items()]
    for i, (label_a, a) in enumerate(items):
        for label_b, b in items[i + 1 :]:
            if _within(a, b) or _within(b, a):
                raise PathSafetyError(f"{label_a} ({a}) and {label_b} ({b}) overlap; use separate directories")


def staging_dir_for(target: Path, fingerprint: str) -> Path:
    """Hidden staging directory beside the target (same filesystem, so rename is atomic).

    Its name depends on the target and the input fingerprint, so rerunning the same export
    finds and resumes the same staging directory.
    """
    key = hashlib.sha256(f"{target}\0{fingerprint}".encode()).hexdigest()[:16]
    return target.parent / f".{target.name}{STAGING_MARKER}{key}"


def lock_path_for(target: Path) -> Path:
    return target.parent / f".{target.name}{LOCK_SUFFIX}"


# The options that name local paths: the staging key holds them resolved, so the same export
# spelled another way (relative, with '..', through a linked parent, from another cwd) resumes.
PATH_OPTIONS = ("local_dir", "base_model", "target_dir", "hf_model_config_path", "test_hf_dir", "adapter_config")


def resolved_path_options(options: dict[str, object]) -> dict[str, object]:
    """`options` with every local path option absolute and resolved; a Hub name (no such path) is kept."""
    out = dict(options)
    for key in PATH_OPTIONS:
        value = out.get(key)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        if key == "target_dir":  # not there yet: its parent is resolved, as check_target does
            out[key] = str(path.parent.resolve() / path.name)
        elif path.exists() or path.is_symlink():
            out[key] = str(path.resolve())
    return out
