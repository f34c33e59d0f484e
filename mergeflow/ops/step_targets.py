"""Where a training step's artifact lives: `<target_root>/<run_name>/global_step_<N>`, for served events and backfill alike.

Both name the same directory for the same step, so a served merge, a backfill and a rerun always agree.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mergeflow.errors import UsageError

# A name an event gives becomes a directory under the target root: letters, digits, '.', '_', '-' only
# (no separators, no control characters a terminal or a file manager would act on), bounded length.
MAX_NAME_LENGTH = 100
SAFE_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAME_LENGTH}}}")


def plain_name(value: Any, what: str) -> str:
    name = value if isinstance(value, str) else ""
    if not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise UsageError(f"the event's {what} {value!r} cannot name a directory; use a plain name: 1-{MAX_NAME_LENGTH} "
                         "letters, digits, '.', '_' or '-' (not '.' or '..')")
    return name


def default_target(target_root: str, run_name: str, step: int | None, actor_dir: Path) -> Path:
    """`<target_root>/<run_name>/global_step_<step>` (the checkpoint's own folder name without a step)."""
    leaf = f"global_step_{step}" if step is not None else plain_name(actor_dir.parent.name, "checkpoint folder")
    return Path(target_root) / run_name / leaf


