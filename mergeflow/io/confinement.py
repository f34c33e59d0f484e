"""Where an event-driven run may read and write: the roots and base models given at serve time.

Anyone who can post an event to the Prefect API chooses a triggered run's `local_dir`,
`target_dir` and `base_model`. The runner must not become a way to read or write anywhere its
user may: every path an event names is resolved (symlinks followed, `..` collapsed) and must
land inside a root the operator named, and a base model must be one the operator allowed.
The checks run before anything is read from or written to those paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import ConfinementError


def _resolved(path: str | os.PathLike[str]) -> Path:
    # strict=False: a target does not exist yet; its existing parents (a symlinked run
    # folder included) are still resolved.
    return Path(os.path.abspath(Path(path).expanduser())).resolve(strict=False)


def is_inside(path: Path, root: Path) -> bool:
    """`path` is `root` or below it (both already resolved)."""
    return path == root or root in path.parents


def confine_read(path: str, root: str) -> str:
    """`path` resolved, when it lies inside `root` (a validate run started from the UI or the API)."""
    resolved, limit = _resolved(path), _resolved(root)
    if not is_inside(resolved, limit):
        raise ConfinementError(f"{path} resolves to {resolved}, outside {limit}, which this deployment may read; nothing was read")
    return str(resolved)


@dataclass(frozen=True)
class Confinement:
    """The operator's limits: checkpoints under `checkpoint_roots`, exports under `target_root`."""

    checkpoint_roots: tuple[str, ...]
    target_root: str
    base_models: tuple[str, ...]

    @classmethod
    def of(cls, checkpoint_roots: list[str] | tuple[str, ...] | None, target_root: str | None,
           base_models: list[str] | tuple[str, ...] | None) -> Confinement:
        """Resolved limits; refused when the operator gave none (an unconfined runner is the hole)."""
        if not checkpoint_roots:
            raise ConfinementError("this deployment names no checkpoint root: serve with --checkpoint-root DIR "
                                   "(or set checkpoint_roots), so events can only point at checkpoints below it")
        if not target_root:
            raise ConfinementError("this deployment names no target root: serve with --target-root DIR "
                                   "(or set target_root), so exports can only land below it")
        return cls(
            checkpoint_roots=tuple(str(_resolved(root)) for root in checkpoint_roots),
            target_root=str(_resolved(target_root)),
            base_models=tuple(str(_resolved(base)) for base in base_models or ()),
        )

    def checkpoint(self, local_dir: str) -> str:
        """The event's checkpoint, resolved, when it lies inside a checkpoint root."""
        resolved = _resolved(local_dir)
        if not any(is_inside(resolved, Path(root)) for root in self.checkpoint_roots):
            raise ConfinementError(
                f"the event's local_dir {local_dir} resolves to {resolved}, outside every checkpoint root "
                f"({', '.join(self.checkpoint_roots)}); nothing was read")
        if resolved.is_dir():  # a huggingface/, fsdp_config.json or .metadata linked out of the roots
            for link in links_in(resolved):
                target = link.resolve(strict=False)
                if not any(is_inside(target, Path(root)) for root in self.checkpoint_roots):
                    raise ConfinementError(
                        f"{link.relative_to(resolved)} in the event's local_dir {resolved} is a symlink to {target}, "
                        f"outside every checkpoint root ({', '.join(self.checkpoint_roots)}); nothing was read")
        return str(resolved)

    def target(self, target_dir: str | os.PathLike[str]) -> str:
        """The run's target, resolved, when it lies strictly below the target root."""
        resolved = _resolved(target_dir)
        root = Path(self.target_root)
        if resolved == root or not is_inside(resolved, root):
            raise ConfinementError(
                f"the target {target_dir} resolves to {resolved}, outside the target root {root}; nothing was written")
        return str(resolved)

    def base_model(self, base_model: str) -> str:
        """The event's base model, resolved, when the operator allowed it."""
        resolved = _resolved(base_model)
        if str(resolved) not in self.base_models:
            allowed = ", ".join(self.base_models) or "none"
            raise ConfinementError(
                f"the event's base_model {base_model} is not one this deployment allows ({allowed}); "
                "serve with --allow-base-model DIR to allow it")
        return str(resolved)


# Every symlink in the trees an export reads is checked before the first read. Inputs may hold a
# link that stays inside their own directory (a `latest` alias, say); a link out of it is refused,
# since the stamps and hashes would vouch for bytes the operator never gave. A base holds no link
# at all, read or not: it is copied and published file by file, and a Hugging Face cache snapshot
# (every file a link into ../../blobs) is refused with the way to get a plain copy.
def links_in(directory: Path) -> list[Path]:
    """Every symlink (to a file, a directory or nothing) below `directory`, never following one."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(directory, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(folder) / name
            if path.is_symlink():
                found.append(path)
    return sorted(found)


def check_input_links(directory: str | os.PathLike[str], what: str) -> None:
    """Refuse a symlink below the input `directory` that resolves outside it (one line, nothing read)."""
    root = _resolved(directory)
    if not root.is_dir():
        return  # the caller's own check names a missing directory
    for link in links_in(root):
        resolved = link.resolve(strict=False)
        if not is_inside(resolved, root):
            raise ConfinementError(f"{link.relative_to(root)} in {what} {root} is a symlink to {resolved}, outside "
                                   f"{what}; mergeflow reads inputs only inside it: copy the file in. Nothing was read")


def check_base_links(base: str | os.PathLike[str]) -> None:
    """Refuse any symlink in the base directory, read by the export or not (a transformer base too)."""
    # The pipeline contract's walk is the one rule for base trees; imported here, at use, since
    # the architectures package sits above this one.
    from mergeflow.architectures.contract import walk_base

    root = _resolved(base)
    if root.is_dir():
        walk_base(root)


def check_export_links(local_dir: str | None, base_model: str | None, config_dir: str | None = None) -> None:
    """The link rules for one export's inputs: the checkpoint, a separate model-config directory, the base."""
    if local_dir:
        check_input_links(local_dir, "--local_dir")
    if config_dir:
        check_input_links(config_dir, "--hf_model_config_path")
    if base_model and Path(base_model).expanduser().is_dir():  # a Hub name (LoRA-only export) is no directory
        check_base_links(base_model)
