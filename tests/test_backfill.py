"""`mergeflow backfill`: every complete, unpublished global_step_N exported, oldest first, resumable."""

from __future__ import annotations

import copy
import json
import signal
from pathlib import Path

import forked_cli
from builders import tree_digest

from mergeflow import merge_model
from mergeflow.config import ModelMergerConfig
from mergeflow.demo.checkpoints import (
    build_transformer,
    perturb_,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.flows.backfill_flow import backfill_flow
from mergeflow.io.staging import staging_dirs_of

CLASS = "FluxTransformer2DModel"


def training_run(root: Path, steps: int = 3) -> tuple[Path, Path]:
    """root/base and root/train/global_step_{1..steps}/actor (2 ranks each, each step trained differently)."""
    base = build_transformer(CLASS, seed=0)
    base_dir = save_base_transformer(base, root / "base")
    for step in range(1, steps + 1):
        actor = copy.deepcopy(base)
        perturb_(actor, seed=step)
        save_fsdp_checkpoint(actor, root / "train" / f"global_step_{step}" / "actor", 2)
    return base_dir, root / "train"


def publish_step(base_dir: Path, train: Path, step: int, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    merge_model(ModelMergerConfig(local_dir=str(train / f"global_step_{step}" / "actor"), base_model=str(base_dir),
                                  target_dir=str(target), output_format="transformer"))


def backfill_args(base_dir: Path, train: Path, out: Path) -> list[str]:
    return ["backfill", str(train), "--base_model", str(base_dir), "--target-root", str(out),
            "--output_format", "transformer", "--stable-seconds", "0"]


def step_lines(stdout: str) -> list[str]:
    lines = stdout.strip().splitlines()
    json.loads(lines[-1])  # the JSON summary is the last line
    return [line for line in lines if line.startswith("global_step_")]


def test_backfill_exports_only_the_missing_complete_step_and_reruns_do_nothing(tmp_path: Path, prefect_server) -> None:  # type: ignore[no-untyped-def]
    base_dir, train = training_run(tmp_path)
    (train / "global_step_3" / "actor" / "model_world_size_2_rank_1.pt").unlink()  # step 3 still being saved
    out = tmp_path / "out"
    publish_step(base_dir, train, 1, out / "train" / "global_step_1")
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}

    first = forked_cli.mergeflow(backfill_args(base_dir, train, out), env)
    assert first.returncode == 0, first.stderr[-2000:]
    lines = step_lines(first.stdout)
    assert [line.split(":")[0] for line in lines] == ["global_step_1", "global_step_2", "global_step_3"]
    assert lines[0].startswith("global_step_1: skipped (already published)")
    assert lines[1] == f"global_step_2: done -> {out / 'train' / 'global_step_2'}"
    assert lines[2].startswith("global_step_3: incomplete (1 of 2 model rank files are not written yet)")
    assert sorted(p.name for p in (out / "train").iterdir()) == ["global_step_1", "global_step_2"]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert [s["status"] for s in summary["steps"]] == ["skipped", "done", "incomplete"]
    published = tree_digest(out)

    again = forked_cli.mergeflow(backfill_args(base_dir, train, out), env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [line.split(" ")[1] for line in step_lines(again.stdout)] == ["skipped", "skipped", "incomplete"]
    assert tree_digest(out) == published


def test_a_killed_backfill_resumes_its_staging(tmp_path: Path, prefect_server, prefect_api) -> None:  # type: ignore[no-untyped-def]
    base_dir, train = training_run(tmp_path, steps=2)
    out = tmp_path / "out"
    publish_step(base_dir, train, 1, out / "train" / "global_step_1")
    target = out / "train" / "global_step_2"
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1", "MERGEFLOW_FAULT_KILL_AT_WRITE": "2"}
    killed = forked_cli.mergeflow(backfill_args(base_dir, train, out), env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not target.exists() and len(staging_dirs_of(target)) == 1  # a shard written, then killed

    # The flow form (what a deployment runs) finds the kept staging and resumes it.
    summary = backfill_flow(train_dir=str(train), base_model=str(base_dir), target_root=str(out),
                            output_format="transformer", stable_seconds=0)
    assert [(s["step"], s["status"], s["detail"]) for s in summary["steps"]] == [
        (1, "skipped", "already published"), (2, "done", "resumed")]
    assert staging_dirs_of(target) == []
    publish_step(base_dir, train, 2, tmp_path / "reference")
    assert tree_digest(target) == tree_digest(tmp_path / "reference")
