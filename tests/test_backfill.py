"""`mergeflow backfill`: every complete, unpublished global_step_N exported, oldest first, resumable."""

from __future__ import annotations

import copy
import json
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import forked_cli
import pytest
import syscall_faults
from builders import tree_digest
from prefect_server import PrefectServer

from mergeflow import merge_model
from mergeflow.config import ModelMergerConfig
from mergeflow.demo.checkpoints import (
    build_transformer,
    perturb_,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.errors import ConfinementError, UsageError
from mergeflow.flows.backfill_flow import backfill_flow
from mergeflow.io.staging import staging_dirs_of

CLASS = "FluxTransformer2DModel"


@dataclass(frozen=True)
class TrainingRun:
    """A base, a verl run of three trained steps, and steps 1 and 2 published by merge_model: read-only, tests clone it."""

    base_dir: Path
    train: Path
    published: Path  # published/global_step_<N>: what an export of step N must write, byte for byte


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


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory, prefect_server: PrefectServer) -> TrainingRun:
    """Built and published once per module: the checkpoints and in-process merges were most of each test's time."""
    root = tmp_path_factory.mktemp("backfill-run")
    base_dir, train = training_run(root)
    with prefect_server.activated():  # on the session's server; without it each merge would start a temporary one
        for step in (1, 2):
            publish_step(base_dir, train, step, root / "published" / f"global_step_{step}")
    return TrainingRun(base_dir, train, root / "published")


@pytest.fixture(scope="module")
def cli_env(prefect_server: PrefectServer) -> dict[str, str]:
    """The CLI's environment: the session server's, so its zygote forks every command (tests/forked_cli.py)."""
    return {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}


def clone_run(run: TrainingRun, dest: Path, steps: tuple[int, ...], published: tuple[int, ...]) -> tuple[Path, Path]:
    """dest/train holding `steps` of the run, dest/out/train holding the published `published`: (train, out)."""
    train, out = dest / "train", dest / "out"
    for step in steps:
        shutil.copytree(run.train / f"global_step_{step}", train / f"global_step_{step}")
    for step in published:
        shutil.copytree(run.published / f"global_step_{step}", out / "train" / f"global_step_{step}")
    return train, out


def backfill_args(base_dir: Path, train: Path, out: Path) -> list[str]:
    return ["backfill", str(train), "--base_model", str(base_dir), "--target-root", str(out),
            "--output_format", "transformer", "--stable-seconds", "0"]


def step_lines(stdout: str) -> list[str]:
    lines = stdout.strip().splitlines()
    json.loads(lines[-1])  # the JSON summary is the last line
    return [line for line in lines if line.startswith("global_step_")]


def test_backfill_exports_only_the_missing_complete_step_and_reruns_do_nothing(
        tmp_path: Path, pristine_run: TrainingRun, cli_env: dict[str, str]) -> None:
    base_dir = pristine_run.base_dir
    train, out = clone_run(pristine_run, tmp_path, steps=(1, 2, 3), published=(1,))
    (train / "global_step_3" / "actor" / "model_world_size_2_rank_1.pt").unlink()  # step 3 still being saved

    first = forked_cli.mergeflow(backfill_args(base_dir, train, out), cli_env)
    assert first.returncode == 0, first.stderr[-2000:]
    lines = step_lines(first.stdout)
    assert [line.split(":")[0] for line in lines] == ["global_step_1", "global_step_2", "global_step_3"]
    assert lines[0].startswith("global_step_1: skipped (already published)")
    assert lines[1] == f"global_step_2: done -> {out / 'train' / 'global_step_2'}"
    assert lines[2].startswith("global_step_3: incomplete (1 of 2 model rank files are not written yet)")
    assert sorted(p.name for p in (out / "train").iterdir()) == ["global_step_1", "global_step_2"]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert [s["status"] for s in summary["steps"]] == ["skipped", "done", "incomplete"]
    # The step the CLI exported is the one merge_model publishes, byte for byte.
    assert tree_digest(out / "train" / "global_step_2") == tree_digest(pristine_run.published / "global_step_2")
    published = tree_digest(out)

    again = forked_cli.mergeflow(backfill_args(base_dir, train, out), cli_env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [line.split(" ")[1] for line in step_lines(again.stdout)] == ["skipped", "skipped", "incomplete"]
    assert tree_digest(out) == published


def test_a_killed_backfill_resumes_its_staging(tmp_path: Path, pristine_run: TrainingRun, cli_env: dict[str, str],
                                               prefect_api: PrefectServer) -> None:
    base_dir = pristine_run.base_dir
    train, out = clone_run(pristine_run, tmp_path, steps=(1, 2), published=(1,))
    target = out / "train" / "global_step_2"
    killed = syscall_faults.mergeflow(["--kill-at-write", "2"], backfill_args(base_dir, train, out), cli_env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not target.exists() and len(staging_dirs_of(target)) == 1  # a shard written, then killed

    # The flow form (what a deployment runs) finds the kept staging and resumes it.
    summary = backfill_flow(train_dir=str(train), base_model=str(base_dir), target_root=str(out),
                            output_format="transformer", stable_seconds=0)
    assert [(s["step"], s["status"], s["detail"]) for s in summary["steps"]] == [
        (1, "skipped", "already published"), (2, "done", "resumed")]
    assert staging_dirs_of(target) == []
    assert tree_digest(target) == tree_digest(pristine_run.published / "global_step_2")


def test_a_served_backfill_reads_and_writes_only_inside_its_roots(tmp_path: Path, pristine_run: TrainingRun,
                                                                 prefect_api: PrefectServer) -> None:
    """With checkpoint_roots (as `mergeflow serve` sets them) a run's form cannot point it elsewhere."""
    train, out = clone_run(pristine_run, tmp_path, steps=(1,), published=())
    out.mkdir()
    inside = tmp_path / "checkpoints"
    inside.mkdir()
    common = {"base_model": str(pristine_run.base_dir), "target_root": str(out), "output_format": "transformer",
              "stable_seconds": 0, "checkpoint_roots": [str(inside)]}
    with pytest.raises(ConfinementError, match="outside every checkpoint root"):
        backfill_flow(train_dir=str(train), **common)
    # A step folder linked in from outside the root is refused before it is read.
    (inside / "run").mkdir()
    (inside / "run" / "global_step_1").symlink_to(train / "global_step_1")
    with pytest.raises(ConfinementError, match="outside every checkpoint root"):
        backfill_flow(train_dir=str(inside / "run"), **common)
    (inside / "clean").mkdir()  # no link to refuse first: the run name's own check answers
    with pytest.raises(UsageError, match="run_name '..' cannot name a directory"):
        backfill_flow(train_dir=str(inside / "clean"), run_name="..", **common)
    assert list(out.iterdir()) == []  # nothing was written


def test_a_fanned_out_backfill_refuses_allow_unchanged_before_dispatching(tmp_path: Path, pristine_run: TrainingRun,
                                                                          prefect_api: PrefectServer) -> None:
    """The merge deployment cannot publish unchanged weights: refused up front, not as failed step runs
    (the fan-out itself runs in tests/test_cluster.py)."""
    train, out = clone_run(pristine_run, tmp_path, steps=(1,), published=())
    with pytest.raises(UsageError, match="allow_unchanged cannot fan out"):
        backfill_flow(train_dir=str(train), base_model=str(pristine_run.base_dir), target_root=str(out),
                      allow_unchanged=True, stable_seconds=0, deployment="mergeflow-merge-checkpoint/on-checkpoint")
    assert not out.exists()


@pytest.mark.parametrize(("deployment", "refusal"), [
    ("nope/missing", "has no deployment 'nope/missing'"),
    ("not-flow-slash-deployment", "is not named FLOW/DEPLOYMENT"),
])
def test_backfill_to_a_deployment_the_server_lacks_is_one_line_and_writes_nothing(
        tmp_path: Path, pristine_run: TrainingRun, cli_env: dict[str, str], deployment: str, refusal: str) -> None:
    """`backfill --deployment` checks the deployment before it dispatches anything (the fan-out that runs is in
    tests/test_cluster.py)."""
    train, out = clone_run(pristine_run, tmp_path, steps=(1, 2), published=())
    done = forked_cli.mergeflow([*backfill_args(pristine_run.base_dir, train, out), "--deployment", deployment],
                                cli_env)
    assert done.returncode != 0
    # The two announcements (the server used, the backfill run's page) come first; then the one refusal.
    errors = [line for line in done.stderr.splitlines() if line.startswith("mergeflow: error:")]
    assert len(errors) == 1 and refusal in errors[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()


def test_a_fanned_out_step_gets_a_relative_local_base_absolute_and_a_hub_id_as_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step runs start on other machines, in other directories (the whole fan-out runs in tests/test_cluster.py)."""
    from mergeflow.flows.backfill_flow import _for_other_machines
    from mergeflow.ops.backfill import BackfillSettings

    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    local = _for_other_machines(BackfillSettings(train_dir="train", base_model="base", target_root="out",
                                                 sign_key="keys/signing.pem"))
    assert (local.base_model, local.sign_key) == (str(tmp_path / "base"), str(tmp_path / "keys" / "signing.pem"))
    hub = _for_other_machines(BackfillSettings(train_dir="train", base_model="Qwen/Qwen-Image", target_root="out"))
    assert (hub.base_model, hub.sign_key) == ("Qwen/Qwen-Image", None)
