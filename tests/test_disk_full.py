"""A full disk at every durable write, and on a real full (or inode-less) filesystem: one line, work kept, no stray lock.

`syscall_faults.FullAtWrite(N)` makes the fsync of the Nth file an export writes fail with ENOSPC,
as a full disk's does, leaving its temporary file behind (mergeflow itself carries no hook). N runs
from 1 until an export finishes before reaching N: every write site of the export is hit once, and
after each failure a plain rerun resumes and publishes the same bytes as a clean export.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import forked_cli
import pytest
from builders import leftovers, make_export, tree_digest
from syscall_faults import FullAtWrite

from mergeflow import merge_model
from mergeflow.errors import DiskFullError

REPO = Path(__file__).resolve().parents[1]
SHARD = 150_000  # two shards of the 272 KB model: every kind of write site, each twice


def test_enospc_at_every_durable_write_is_one_error_and_resumes(tmp_path: Path, prefect_api: Any) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)
    want = tree_digest(Path(merge_model(ex.config(tmp_path / "reference", max_shard_size=SHARD)).output_dir))
    failed = 0
    for n in range(1, 40):
        target = tmp_path / f"out-{n}"
        full = FullAtWrite(n)
        try:
            with full:
                merge_model(ex.config(target, max_shard_size=SHARD))
        except DiskFullError as exc:
            failed += 1
            message = str(exc)
            assert "\n" not in message and message.startswith("no space left") and "No space left on device" in message
            assert exc.staging_dir and Path(exc.staging_dir).is_dir(), f"write {n}: the work was not kept"
            assert Path(full.failed).is_file(), f"write {n}: the file that did not fit is gone"  # as a real full disk leaves it
            assert not target.exists(), f"ENOSPC at write {n} published a partial target"
            assert not (tmp_path / f".{target.name}.mergeflow.lock").exists(), f"ENOSPC at write {n} left the lock"
        else:  # fewer than n durable writes: every site was hit
            # Not a failed write that a retry papered over: the fault never reached n.
            assert full.seen < n, f"ENOSPC at write {n} was retried away"
            assert tree_digest(target) == want
            break
        merge_model(ex.config(target, max_shard_size=SHARD))  # free space again: the same command resumes
        assert tree_digest(target) == want, f"the resumed artifact after ENOSPC at write {n} differs"
        assert leftovers(tmp_path, f".{target.name}.") == [], "the resume left staging or a lock behind"
    else:
        raise AssertionError("the export never finished: the fault fired at every count")
    assert failed >= 6  # 2 x (shard file, its record), config.json, the manifest
    print(f"reliability: ENOSPC at {failed} durable write(s), {failed} refused in one line and resumed byte-identical, 0 lost")


@pytest.mark.parametrize("stage", ["vae/", "model_index.json"], ids=["copying-a-component", "the-pipeline-index"])
def test_enospc_while_building_a_pipeline_resumes(tmp_path: Path, prefect_api: Any, stage: str) -> None:
    """The stages a transformer export has not: the base's component copies and model_index.json."""
    from fixtures.pipelines_image import build_sd3_pipeline
    from pipeline_builders import Exported, make_actor

    from mergeflow.demo.checkpoints import build_transformer

    transformer = build_transformer("SD3Transformer2DModel")
    base = build_sd3_pipeline(tmp_path / "base", transformer)
    actor, actor_dir = make_actor(transformer, tmp_path)
    item = Exported(base, actor_dir, actor)
    want = tree_digest(Path(merge_model(item.config(tmp_path / "reference")).output_dir))
    target = tmp_path / "out"
    within = stage
    if stage == "model_index.json":
        # Written from the bytes planning read (mergeflow.io.session): no read of it names the file, but its
        # temporary file's name does (copy-<digest of its path>-<pid>.partial).
        from mergeflow.export.write.copy_files import _temp_name

        within = _temp_name(Path(), stage).name.rsplit("-", 1)[0]
    with pytest.raises(DiskFullError, match="no space left") as info, FullAtWrite(1, within=within):  # the stage's first file
        merge_model(item.config(target))
    assert info.value.staging_dir and not target.exists() and not (tmp_path / ".out.mergeflow.lock").exists()
    assert stage in str(info.value)  # the file that did not fit is named
    merge_model(item.config(target))
    assert tree_digest(target) == want and leftovers(tmp_path, ".out.") == []


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.parametrize("options,what", [("size=256k", "a 256 KB filesystem"), ("size=64m,nr_inodes=4", "no free inodes")])
def test_a_really_full_filesystem_is_one_line_without_a_stray_lock(tmp_path: Path, prefect_server: Any, options: str,
                                                                  what: str) -> None:
    """The real kernel ENOSPC where a mount is allowed (root in a container); the fsync fault above covers every site."""
    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, options):
        pytest.skip("mounting a tmpfs is not permitted here; ENOSPC is covered by the fsync fault above")
    try:
        ex = make_export(tmp_path / "in", "FluxTransformer2DModel", 2)
        (mount / "pad").mkdir()  # an inode in use; with size=..k the export's data does not fit
        target = mount / "out"
        done = forked_cli.mergeflow(
            ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
             "--target_dir", str(target), "--output_format", "transformer"], prefect_server.client_env(), timeout=240)
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("mergeflow: flow run")]
        assert done.returncode == 2, done.stderr[-3000:]
        assert lines[-1].startswith("mergeflow: error: no space left"), (what, lines[-1])
        assert not target.exists() and not (mount / ".out.mergeflow.lock").exists(), sorted(p.name for p in mount.iterdir())
    finally:
        subprocess.run(["umount", str(mount)], check=False)
