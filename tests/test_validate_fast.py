"""`mergeflow test` runs its integrity checks in-process: no Prefect, no torch, same checks as the validate flow."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import make_export

from mergeflow import merge_model, validate_artifact
from mergeflow.errors import ArtifactInvalidError
from mergeflow.export.check.artifact_check import (
    PARALLEL_HASH_MIN_BYTES,
    check_artifact,
    check_tree_and_hashes,
)
from mergeflow.io.paths import staging_dir_for

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers", "prefect", "huggingface_hub", "numpy", "safetensors", "peft")
EXPECTED = {"integrity": "passed", "architecture": "FluxTransformer2DModel"}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory, prefect_server) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    """One real export with several shards and an index, shared (read-only) by this module's tests."""
    root = tmp_path_factory.mktemp("fast-test")
    ex = make_export(root, "FluxTransformer2DModel", 2)
    with prefect_server.activated():
        out = Path(merge_model(ex.config(root / "out", max_shard_size=60_000)).output_dir)
    assert len(list(out.glob("*.safetensors"))) > 1
    yield out


@pytest.fixture()
def artifact(published: Path, tmp_path: Path) -> Path:
    """A private copy of the published artifact that a test may damage."""
    return Path(shutil.copytree(published, tmp_path / "artifact"))


def run_test_command(path: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`python -m mergeflow test` as users type it, with Prefect unconfigured; also the top-level modules it imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mergeflow", "test", "--backend", "fsdp", "--test_hf_dir", str(path)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, imported


def user_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("import time:")]


def test_cli_test_passes_without_prefect_or_torch(published: Path) -> None:
    proc, imported = run_test_command(published)
    assert proc.returncode == 0, user_lines(proc.stderr)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == EXPECTED
    assert "mergeflow" in imported  # the importtime parse sees our own modules
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_cli_main_leaves_heavy_modules_unimported(published: Path) -> None:
    """The console script's entry point (mergeflow.deployments.cli:main), checked through sys.modules."""
    code = (
        "import json, sys\n"
        "from mergeflow.deployments.cli import main\n"
        f"rc = main(['test', '--backend', 'fsdp', '--test_hf_dir', {str(published)!r}])\n"
        f"print(json.dumps({{'rc': rc, 'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == EXPECTED
    assert json.loads(lines[-1]) == {"rc": 0, "heavy": []}


def test_a_flipped_byte_in_a_shard_fails_with_one_line(artifact: Path) -> None:
    shard = sorted(artifact.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc, imported = run_test_command(artifact)
    lines = user_lines(proc.stderr)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("mergeflow: error:") and shard.name in lines[0] and "sha256" in lines[0]
    assert not imported & set(HEAVY)


def test_an_extra_file_fails_with_one_line(artifact: Path) -> None:
    (artifact / "notes.txt").write_text("not part of the export\n")
    proc, _ = run_test_command(artifact)
    lines = user_lines(proc.stderr)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("mergeflow: error:") and "notes.txt" in lines[0], lines


def test_a_missing_file_and_a_symlink_fail(artifact: Path) -> None:
    config = artifact / "config.json"
    config.rename(artifact / "config.moved")
    (artifact / "config.json").symlink_to("config.moved")
    with pytest.raises(ArtifactInvalidError, match="symlink"):
        check_artifact(artifact)
    (artifact / "config.json").unlink()
    (artifact / "config.moved").unlink()
    with pytest.raises(ArtifactInvalidError, match="config.json is listed in the manifest but missing"):
        check_artifact(artifact)


def test_a_kept_staging_dir_validates_as_the_artifact_inside_it(published: Path, tmp_path: Path) -> None:
    staging = staging_dir_for(tmp_path / "target", "f" * 64)
    shutil.copytree(published, staging / "artifact")
    proc, _ = run_test_command(staging)
    assert proc.returncode == 0, user_lines(proc.stderr)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == EXPECTED


def test_the_validate_flow_runs_the_same_checks(artifact: Path, prefect_api: object) -> None:
    assert validate_artifact(artifact) == check_artifact(artifact) == EXPECTED
    (artifact / "extra.bin").write_bytes(b"\0")
    with pytest.raises(ArtifactInvalidError, match="extra.bin is in the artifact but not in the manifest"):
        check_artifact(artifact)
    with pytest.raises(ArtifactInvalidError, match="extra.bin is in the artifact but not in the manifest"):
        validate_artifact(artifact)


def test_big_files_hashed_in_parallel_are_checked_byte_for_byte(tmp_path: Path) -> None:
    """Files above the threshold go to the thread pool; a changed byte in any of them is still caught."""
    sizes = {"a.bin": PARALLEL_HASH_MIN_BYTES + 1, "b.bin": PARALLEL_HASH_MIN_BYTES * 2 + 3, "c.json": 10, "empty": 0}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(os.urandom(size))
    files = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in sizes}
    check_tree_and_hashes(tmp_path, files)
    with open(tmp_path / "b.bin", "r+b") as handle:
        handle.seek(PARALLEL_HASH_MIN_BYTES + 7)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ArtifactInvalidError, match="b.bin does not match its sha256"):
        check_tree_and_hashes(tmp_path, files)


def _edit_manifest(artifact: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = artifact / "merge_manifest.json"
    path.write_bytes(edit(path.read_bytes()))


@pytest.mark.parametrize("edit, match", [
    (lambda raw: raw + b" ", "canonical"),  # whitespace the parser would forgive
    (lambda raw: raw.replace(b"\n", b"\r\n"), "canonical"),
    (lambda raw: json.dumps(json.loads(raw), indent=4, sort_keys=True).encode() + b"\n", "canonical"),
    (lambda raw: json.dumps(dict(reversed(json.loads(raw).items())), indent=2).encode() + b"\n", "canonical"),
], ids=["appended-space", "crlf", "indent-4", "unsorted"])
def test_a_manifest_that_is_not_byte_for_byte_canonical_is_refused(artifact: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    _edit_manifest(artifact, edit)
    with pytest.raises(ArtifactInvalidError, match=match):
        check_artifact(artifact)


def test_an_extra_empty_directory_is_refused(artifact: Path) -> None:
    (artifact / "scratch" / "deeper").mkdir(parents=True)
    with pytest.raises(ArtifactInvalidError, match="scratch/ is in the artifact but holds no file of the manifest"):
        check_artifact(artifact)


def test_the_published_artifact_passes_as_written(published: Path) -> None:
    assert check_artifact(published)["integrity"] == "passed"
