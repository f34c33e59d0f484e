"""The refusals that need no tensor data, answered before Prefect, torch or diffusers load.

`preflight_merge` runs in the command line before any Prefect server is started or
contacted, so a wrong path or flag costs a fraction of a second instead of a server start.
It reads directory listings and small JSON files only. It is the first stage of the flow's
inspect task too (`build_plan`), which runs it when the command line did not in this export;
the pre-flight may only refuse what the flow would refuse too, never something it would accept. Where the flow's
decision depends on the rank files' keys (is this a LoRA-only save?), the pre-flight runs
only the checks that every branch of that decision runs.
"""

from __future__ import annotations

from pathlib import Path

from mergeflow.config import ModelMergerConfig
from mergeflow.export.plan.input_checks import config_key, require_local_dir
from mergeflow.io.os_errors import check_target_parent
from mergeflow.io.session import active_session
from mergeflow.sources.registry import source_for


def preflight_merge(config: ModelMergerConfig) -> list[Path]:
    """Refuse a merge whose flags, paths, fsdp_config.json, rank-file set or classes are wrong.

    The first stage of planning (`build_plan` starts with it): the command line runs it before
    Prefect starts, and the flow's inspect task then finds its answer in the export's session
    (mergeflow.io.session) instead of reading the files again; a served run runs it in the task.
    Returns the checkpoint files it found; within an export they are being hashed from then on.
    """
    session = active_session()
    if session is None:
        return _stage_one(config)
    files: list[Path] = session.once("plan-stage-1", config_key(config), lambda: _stage_one(config))
    if files:
        # The manifest's source-file digests, hashed from now on on the core the imports leave idle.
        hasher = source_for(files[0].parent).file_hasher(config.trust_checkpoint)  # after the refusals: may import torch
        session.digests.start(files, hasher=hasher)
    return files


def _stage_one(config: ModelMergerConfig) -> list[Path]:
    config.validate()
    if config.sign_key:  # a wrong key is refused now, not after the export was written
        from mergeflow.signing import load_signing_key

        load_signing_key(config.sign_key)
    actor = Path(config.local_dir or "").expanduser().resolve()
    require_local_dir(actor)
    check_target_parent(Path(config.target_dir or ""))  # else the flow's first write says it, after a server start
    from mergeflow.io.confinement import (
        check_export_links,  # links out of the inputs: refused before any read
    )

    check_export_links(config.local_dir, config.base_model, config.hf_model_config_path)
    return source_for(actor).preflight(config, actor)  # its own checks, from the shared ones below
