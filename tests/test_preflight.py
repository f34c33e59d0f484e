"""Refusals that need no tensor data answer before Prefect: no server, no torch, no diffusers.

The CLI subprocesses below get a PREFECT_API_URL where nothing listens and may start no
background server: a refusal that reached Prefect would fail differently (or hang on it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from builders import Export, make_export

from mergeflow import errors as E
from mergeflow.export.plan.input_checks import _diffusers_exported_names
from mergeflow.export.plan.preflight import preflight_merge

REPO = Path(__file__).resolve().parents[1]
UNREACHABLE_API = "http://127.0.0.1:9/api"  # the discard port: nothing answers there


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Export:
    return make_export(tmp_path_factory.mktemp("preflight"), "FluxTransformer2DModel", 2)


@pytest.fixture()
def ex(source: Export, tmp_path: Path) -> Export:
    """A private copy of the tiny export, free to damage."""
    return _private_copy(source, tmp_path)


def refusal_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.pop("MERGEFLOW_LOCAL_SERVER", None)  # a background server would start if anything got that far
    env.update(PREFECT_API_URL=UNREACHABLE_API, PREFECT_HOME=str(home), HF_HUB_OFFLINE="1")
    return env


def merge_args(ex: Export, target: Path, **flags: str) -> list[str]:
    args = {"--local_dir": str(ex.actor_dir), "--target_dir": str(target), "--base_model": str(ex.base_dir),
            "--output_format": "transformer", **flags}
    return ["merge", "--backend", "fsdp", *[part for item in args.items() for part in item]]


def _missing_local_dir(ex: Export) -> list[str]:
    return merge_args(ex, ex.root / "out", **{"--local_dir": str(ex.root / "no-such-actor")})


def _missing_step(ex: Export) -> list[str]:
    # The run saved steps 1, 60 and 80 (actor/ in each); the user typed step 70.
    run = ex.actor_dir.parents[1]
    for step in (60, 80):
        (run / f"global_step_{step}" / "actor").mkdir(parents=True)
    return merge_args(ex, ex.root / "out", **{"--local_dir": str(run / "global_step_70" / "actor")})


def _existing_target(ex: Export) -> list[str]:
    (ex.root / "taken").mkdir()
    return merge_args(ex, ex.root / "taken")


def _overlapping_dirs(ex: Export) -> list[str]:
    return merge_args(ex, ex.actor_dir / "out")


def _malformed_fsdp_config(ex: Export) -> list[str]:
    (ex.actor_dir / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": ')
    return merge_args(ex, ex.root / "out")


def _missing_rank_file(ex: Export) -> list[str]:
    (ex.actor_dir / "model_world_size_2_rank_1.pt").unlink()
    return merge_args(ex, ex.root / "out")


def _unknown_class(ex: Export) -> list[str]:
    for path in (ex.base_dir / "config.json", ex.actor_dir / "huggingface" / "config.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "_class_name": "MysteryTransformer9000"}))
    return merge_args(ex, ex.root / "out")


def _unknown_pipeline_class(ex: Export) -> list[str]:
    (ex.base_dir / "model_index.json").write_text(json.dumps({"_class_name": "MysteryPipeline", "transformer": ["diffusers", "X"]}))
    return merge_args(ex, ex.root / "out")


def _pipeline_output_of_a_transformer_base(ex: Export) -> list[str]:
    return merge_args(ex, ex.root / "out", **{"--output_format": "pipeline"})


def _fuse_lora_without_lora(ex: Export) -> list[str]:
    return [*merge_args(ex, ex.root / "out"), "--fuse-lora"]


def _adapter_name_without_lora(ex: Export) -> list[str]:
    return [*merge_args(ex, ex.root / "out"), "--adapter-name", "mine"]


def _adapter_format_without_lora(ex: Export) -> list[str]:
    return [*merge_args(ex, ex.root / "out"), "--adapter-format", "diffusers"]


def _adapter_config_without_lora(ex: Export) -> list[str]:
    (ex.root / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    return [*merge_args(ex, ex.root / "out"), "--adapter-config", str(ex.root / "adapter_config.json")]


def _dcp_without_a_model_config(ex: Export) -> list[str]:
    # A DCP (accelerate's pytorch_model_fsdp_0/) carries no config, and a Hub-named base has none here either:
    # refused from the listing alone, without reading .metadata (a pickle: torch would be imported).
    dcp_dir = ex.root / "pytorch_model_fsdp_0"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"not read by the pre-flight")
    (dcp_dir / "__0_0.distcp").write_bytes(b"")
    return merge_args(ex, ex.root / "out", **{"--local_dir": str(dcp_dir), "--base_model": "tiny-org/flux"})


REFUSALS: dict[str, tuple[Callable[[Export], list[str]], str]] = {
    "missing-local-dir": (_missing_local_dir, "no-such-actor does not exist"),
    "missing-step": (_missing_step, "global_step_70/actor does not exist; the nearest checkpoints of that run: "),
    "existing-target": (_existing_target, "already exists"),
    "overlapping-dirs": (_overlapping_dirs, "overlap"),
    "malformed-fsdp-config": (_malformed_fsdp_config, "fsdp_config.json is not valid JSON"),
    "missing-rank-file": (_missing_rank_file, "missing"),
    "unknown-class": (_unknown_class, "unknown model class 'MysteryTransformer9000'"),
    "unknown-pipeline-class": (_unknown_pipeline_class, "unknown pipeline class"),
    "pipeline-output-needs-pipeline-base": (_pipeline_output_of_a_transformer_base, "needs a base pipeline"),
    "fuse-lora-without-lora": (_fuse_lora_without_lora, "--fuse-lora"),
    "adapter-name-without-lora": (_adapter_name_without_lora, "--adapter-name is for LoRA checkpoints"),
    "adapter-format-without-lora": (_adapter_format_without_lora, "--adapter-format is for LoRA checkpoints"),
    "adapter-config-without-lora": (_adapter_config_without_lora, "--adapter-config is for LoRA checkpoints"),
    "dcp-without-a-model-config": (_dcp_without_a_model_config, "a DCP checkpoint carries no model config"),
}


# Every refusal in one fresh interpreter (a cold start per case would cost seconds each): each case runs the
# CLI's `main` on its own damaged copy with stdout and stderr captured, and reports what was imported after it.
_HARNESS = """
import contextlib, io, json, sys
from mergeflow.flows.cli import main
report = {}
for name, args in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
    loaded = sorted(m for m in ("torch", "prefect", "diffusers") if m in sys.modules)
    report[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "loaded": loaded}
print(json.dumps(report))
"""


def _private_copy(source: Export, root: Path) -> Export:
    """A private copy of the tiny export, free to damage."""
    shutil.copytree(source.root / "base", root / "base")
    shutil.copytree(source.root / "ckpt", root / "ckpt")
    return Export(root, root / source.actor_dir.relative_to(source.root), root / "base", source.actor, source.class_name)


def test_every_refusal_answers_in_one_line_without_prefect_torch_or_diffusers(source: Export, tmp_path: Path) -> None:
    copies = {case: _private_copy(source, tmp_path / case) for case in REFUSALS}
    cases = {case: REFUSALS[case][0](copy) for case, copy in copies.items()}
    cases["bad-flag-value"] = merge_args(copies["existing-target"], tmp_path / "out", **{"--dtype": "int4"})
    home = tmp_path / "prefect-home"
    proc = subprocess.run([sys.executable, "-c", _HARNESS, json.dumps(cases)], env=refusal_env(home), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # nothing reached the real stderr past the captures
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (_, message) in REFUSALS.items():
        got = report[case]
        lines = [line for line in got["stderr"].splitlines() if line.strip()]
        assert got["code"] == 2 and got["stdout"] == "", (case, got)
        assert len(lines) == 1 and lines[0].startswith("mergeflow: error:") and message in lines[0], (case, got)
        assert got["loaded"] == [], (case, got)  # cumulative: no refusal so far imported any of them
        assert not (copies[case].root / "out").exists(), case
    assert report["bad-flag-value"]["code"] == 2 and "invalid choice" in report["bad-flag-value"]["stderr"]
    assert not (home / "mergeflow-server.json").exists(), "a background server was started"


def test_a_refusal_through_python_m_mergeflow_is_exit_2_and_one_line(ex: Export, tmp_path: Path) -> None:
    """The real entry point users type, once: its exit status and streams, in a process of its own."""
    home = tmp_path / "prefect-home"
    proc = subprocess.run([sys.executable, "-m", "mergeflow", *_existing_target(ex)], env=refusal_env(home), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith("mergeflow: error:") and "already exists" in lines[0]
    assert not (home / "mergeflow-server.json").exists()


def test_a_missing_local_dir_lists_the_runs_nearest_checkpoints(ex: Export) -> None:
    run = ex.actor_dir.parents[1]  # holds global_step_1/actor
    for step in (20, 60, 80, 200):
        (run / f"global_step_{step}" / "actor").mkdir(parents=True)
    (run / "global_step_75").mkdir()  # no actor/ in it (an interrupted save): listed as it is
    (run / "global_step_x").mkdir()  # not a step
    with pytest.raises(E.CheckpointError) as info:
        preflight_merge(ex.config(ex.root / "out", local_dir=str(run / "global_step_70" / "actor")))
    assert str(info.value) == (f"--local_dir {run / 'global_step_70' / 'actor'} does not exist; the nearest checkpoints "
                               f"of that run: {run / 'global_step_75'}, {run / 'global_step_80' / 'actor'}, "
                               f"{run / 'global_step_60' / 'actor'}")
    with pytest.raises(E.CheckpointError, match=r"does not exist; the nearest checkpoints of that run: .*global_step_200/actor, "):
        preflight_merge(ex.config(ex.root / "out", local_dir=str(run / "actor")))  # no step typed: the latest first
    with pytest.raises(E.CheckpointError) as info:
        preflight_merge(ex.config(ex.root / "out", local_dir=str(ex.root / "elsewhere" / "actor")))
    assert str(info.value) == f"--local_dir {ex.root / 'elsewhere' / 'actor'} does not exist"  # no run there: no list
    (ex.root / "a-file").write_text("")
    with pytest.raises(E.CheckpointError, match="a-file is not a directory$"):
        preflight_merge(ex.config(ex.root / "out", local_dir=str(ex.root / "a-file")))


@pytest.fixture()
def read_only_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """An existing directory no file can be created in, and the refusal's reason: a read-only tmpfs where a
    mount is allowed (root in a container; root ignores mode bits), else mode 0555 for a user who is not root."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(path)], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip("root without permission to mount: no directory root cannot write to")
        try:
            yield path, "read-only filesystem"
        finally:
            subprocess.run(["umount", str(path)], check=False)
        return
    path.chmod(0o555)
    try:
        yield path, "permission denied"
    finally:
        path.chmod(0o755)


def _one_refusal(args: list[str], env: dict[str, str]) -> str:
    """Run the real entry point once; assert exit 2, one `mergeflow: error:` line, no stdout; return that line."""
    proc = subprocess.run([sys.executable, "-m", "mergeflow", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith("mergeflow: error: "), lines
    return lines[0]


def test_an_unwritable_target_parent_is_refused_by_the_preflight(ex: Export, tmp_path: Path,
                                                                  read_only_dir: tuple[Path, str]) -> None:
    """Refused before Prefect (no server, no run to fail in the UI), naming the parent and the fix."""
    parent, reason = read_only_dir
    home = tmp_path / "prefect-home"
    line = _one_refusal(merge_args(ex, parent / "out"), refusal_env(home))
    assert line.startswith(f"mergeflow: error: {reason}: {parent} (the parent of --target_dir)"), line
    assert not (home / "mergeflow-server.json").exists() and not home.exists()
    with pytest.raises(E.FileAccessError, match=reason):  # the pre-flight itself, as the CLI runs it
        preflight_merge(ex.config(parent / "out"))
    with pytest.raises(E.TargetExistsError):  # an existing target keeps its own refusal
        preflight_merge(ex.config(parent))


def test_an_unusable_prefect_home_is_named_before_any_work(ex: Export, tmp_path: Path,
                                                            read_only_dir: tuple[Path, str]) -> None:
    """PREFECT_HOME read-only, a file, or under a file: one line naming PREFECT_HOME, never the target."""
    ro, reason = read_only_dir
    (tmp_path / "a-file").write_text("")
    fix = "set PREFECT_HOME to a writable directory"
    cases = {
        ro: f"PREFECT_HOME {ro} is unusable: {reason}; {fix}",
        ro / "prefect": f"PREFECT_HOME {ro / 'prefect'} is unusable: {reason} (it does not exist, and cannot be created in {ro}); {fix}",
        tmp_path / "a-file": f"PREFECT_HOME {tmp_path / 'a-file'} is not a directory; {fix}",
        tmp_path / "a-file" / "prefect": f"PREFECT_HOME {tmp_path / 'a-file' / 'prefect'} cannot be created ({tmp_path / 'a-file'} is not a directory); {fix}",
    }
    for n, (home, message) in enumerate(cases.items()):
        line = _one_refusal(merge_args(ex, tmp_path / f"out{n}"), refusal_env(home))
        assert line.startswith(f"mergeflow: error: {message}"), line
        assert not (tmp_path / f"out{n}").exists()
    line = _one_refusal(["server", "start"], refusal_env(tmp_path / "a-file"))
    assert line.startswith(f"mergeflow: error: PREFECT_HOME {tmp_path / 'a-file'} is not a directory"), line


def test_preflight_accepts_a_good_export(ex: Export) -> None:
    preflight_merge(ex.config(ex.root / "out"))


def test_a_lora_run_may_name_a_hub_base(ex: Export) -> None:
    """A LoRA-only save exports its adapter without a local base: only the rank files' keys tell, so accept."""
    (ex.actor_dir / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "task_type": None}))
    preflight_merge(ex.config(ex.root / "out", base_model="tiny-org/flux"))
    with pytest.raises(E.TargetExistsError):  # the checks every LoRA export runs still run
        preflight_merge(ex.config(ex.actor_dir.parent, base_model="tiny-org/flux"))
    with pytest.raises(E.UsageError, match="not a local directory"):  # fusing always needs the base
        preflight_merge(ex.config(ex.root / "out", base_model="tiny-org/flux", fuse_lora=True))


def test_class_mismatch_is_refused_like_the_flow(ex: Export) -> None:
    path = ex.actor_dir / "huggingface" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(E.SchemaMismatchError, match="is a SD3Transformer2DModel but the base transformer is a Flux"):
        preflight_merge(ex.config(ex.root / "out"))


def test_diffusers_names_are_read_completely_from_its_index() -> None:
    """Every name the installed diffusers exports is found without importing it (else a false refusal)."""
    import diffusers
    from diffusers import ModelMixin

    names = _diffusers_exported_names()
    assert names is not None
    exported = {n for n in diffusers.__all__ if re.fullmatch(r"[A-Z]\w*", n)}  # classes, not submodules
    assert len(exported & names) > 100
    # Names built at import time (dummies of a missing backend) are never Diffusers model classes.
    unseen = [n for n in exported - names if isinstance(getattr(diffusers, n), type) and issubclass(getattr(diffusers, n), ModelMixin)]
    assert unseen == []
    assert "MysteryTransformer9000" not in names
