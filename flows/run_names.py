"""Readable names of flow runs and artifact keys in the Prefect UI.

Every training run saves `global_step_100`, so a target's leaf alone names nothing: a name
carries the training run and step when the layout tells them (`<run>-step<N>`, the source's
before the target's), else the target's parent and leaf. Names use only what Prefect artifact keys accept (lowercase
letters, digits, dashes), so one label serves both the run name and the artifact keys.
"""

from __future__ import annotations

from pathlib import Path

from mergeflow.formats.verl_checkpoint import verl_run_step
from mergeflow.io.staging import is_staging_dir, target_of

# Artifact keys are at most 100 characters; the run part is cut, never the step that tells runs apart.
MAX_RUN_CHARS = 60


def slug(text: str) -> str:
    """Lowercase letters, digits and single dashes only (what Prefect artifact keys accept)."""
    cleaned = "".join(c if c.isascii() and c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in cleaned.split("-") if part)


def export_label(target: str | Path | None, local_dir: str | Path | None = None) -> str:
    """`<run>-step<N>` when the source (or else the target) is in verl's layout, else `<parent>-<leaf>` of the target.

    The source first: `myrun/global_step_7/actor` exported to `exports/global_step_7` is myrun's step 7,
    not a run called "exports"; a target names the run only when the source does not.
    """
    for path in (local_dir, target):
        found = verl_run_step(Path(str(path))) if path else None
        if found is not None:
            run, step = found
            return f"{(slug(run) or 'run')[:MAX_RUN_CHARS].strip('-')}-step{step}"
    where = Path(str(target or "artifact"))
    return slug(f"{where.parent.name}-{where.name}")[-2 * MAX_RUN_CHARS:].strip("-") or "artifact"


def validate_label(test_hf_dir: str | Path | None) -> str:
    """The label of what is validated; a failed merge's kept staging dir is named after its target."""
    path = Path(str(test_hf_dir or "artifact"))
    if path.name == "artifact" and is_staging_dir(path.parent):  # the artifact inside a staging dir
        path = path.parent
    if is_staging_dir(path):
        return f"{export_label(target_of(path))}-staging"
    return export_label(path)
