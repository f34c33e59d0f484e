"""kill -9 at every durable write of an export, then a rerun: it resumes and publishes the same bytes.

`syscall_faults.KillAtWrite` kills the command (SIGKILL, from its own process) at its Nth durable
write: the Nth rename of a file it fsynced, just before that rename, when the new bytes are on disk
under their temporary name. mergeflow itself carries no hook. N runs from 1 until an export finishes
before reaching N, so every write site of this export is hit.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import forked_cli
import pytest
import syscall_faults
from builders import Export, clone_export, leftovers, make_export, tree_digest

from mergeflow import merge_model

REPO = Path(__file__).resolve().parents[1]


def _merge(ex: Export, target: Path, env: dict[str, str], fault: list[str] | None = None,
           output_format: str = "transformer", quantize: str = "none") -> subprocess.CompletedProcess[str]:
    """The merge command; with `fault` (syscall_faults' options), under that fault."""
    args = ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
            "--target_dir", str(target), "--output_format", output_format, "--quantize", quantize]
    return syscall_faults.mergeflow(fault, args, env) if fault else forked_cli.mergeflow(args, env)


# single_file: Flux's original layout, whose fused tensors the writer builds from several sources;
# with fp8, also the kept quantization records (work/quantization-*.json) the manifest is built from.
# gguf: the same tensors through the GGUF writer, whose resume record also holds the quantization record.
@pytest.mark.parametrize(("output_format", "quantize"), [("transformer", "none"), ("single_file", "none"),
                                                         ("single_file", "fp8"), ("gguf", "q8_0")])
def test_a_kill_at_every_durable_write_resumes_to_the_same_bytes(tmp_path: Path, prefect_server, prefect_api,  # type: ignore[no-untyped-def]
                                                                 output_format: str, quantize: str) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}
    reference = tmp_path / "reference"
    merge_model(ex.config(reference, output_format=output_format, quantize=quantize))  # the same flow the CLI runs; the CLI runs are the killed ones
    want = tree_digest(reference)
    killed = 0
    for n in range(1, 40):
        target = tmp_path / f"out-{n}"
        proc = _merge(ex, target, env, ["--kill-at-write", str(n)], output_format, quantize)
        if proc.returncode == 0:  # the export has fewer than n durable writes: every site was hit
            assert tree_digest(target) == want
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        killed += 1
        assert not target.exists(), f"a kill at write {n} published a partial target"
        # The rerun runs in this process (the same flow as the CLI, without another interpreter start):
        # what is under test is what the killed process left behind.
        assert merge_model(ex.config(target, output_format=output_format, quantize=quantize)).output_dir == str(target), \
            f"the rerun after a kill at write {n} failed"
        assert tree_digest(target) == want, f"the resumed artifact after a kill at write {n} differs"
        assert leftovers(tmp_path, f".{target.name}.") == [], "the resume left staging or a lock behind"
    else:
        raise AssertionError("the export never finished: the kill fired at every count")
    assert killed >= 4  # the shard file, its record, config.json, the manifest
    print(f"reliability: kill -9 at {killed} durable write(s), {killed} recovered byte-identical, 0 lost")


def test_a_resume_removes_what_killed_writers_left(tmp_path: Path) -> None:
    from mergeflow.io.jsonfiles import partial_name, write_bytes_durable
    from mergeflow.io.staging import remove_partial_writes

    staging = tmp_path / ".out.mergeflow-staging-abc"
    (staging / "artifact" / "transformer").mkdir(parents=True)
    write_bytes_durable(staging / "artifact" / "config.json", b"{}\n")
    left = [partial_name(staging / "artifact" / "model_index.json"),
            staging / "artifact" / "transformer" / ".config.json.tmp-28989"]  # the name earlier versions used
    for path in left:
        path.write_bytes(b"half")
    keep = staging / "artifact" / ".gitattributes"
    keep.write_bytes(b"*.safetensors filter=lfs\n")
    removed = remove_partial_writes(staging)
    assert removed == sorted(p.relative_to(staging).as_posix() for p in left)
    assert not any(p.exists() for p in left) and keep.exists() and (staging / "artifact" / "config.json").exists()
    assert os.listdir(staging / "artifact" / "transformer") == []


@pytest.mark.parametrize("stage", syscall_faults.PUBLISH_STAGES)
def test_a_kill_after_the_publish_rename_is_cleared_by_the_next_command(tmp_path: Path, prefect_server, prefect_api,  # type: ignore[no-untyped-def]
                                                                        pristine_flux_w2, stage: str) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}
    target = tmp_path / "out"
    killed = _merge(ex, target, env, ["--kill-after-publish", stage, "--target", str(target)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (target / "merge_manifest.json").is_file(), "the kill came before the publish rename"
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert tmp_path / ".out.mergeflow.lock" in left and len(left) == (1 if stage == "staging-removed" else 2), left
    want = tree_digest(target)
    rerun = _merge(ex, target, env)
    assert rerun.returncode == 2, rerun.stderr[-2000:]
    line = rerun.stderr.strip().splitlines()[-1]
    assert line.startswith("mergeflow: error: target") and "already exists" in line, rerun.stderr
    assert "removed what an interrupted publish left beside it" in line and all(str(p) in line for p in left), line
    assert leftovers(tmp_path, ".out.") == [], "the staging dir or the lock is still there"
    assert tree_digest(target) == want  # the published artifact is untouched
    again = _merge(ex, target, env)
    assert again.returncode == 2 and "interrupted publish" not in again.stderr  # said once, when it was done
