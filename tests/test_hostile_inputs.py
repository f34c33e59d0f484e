"""The hostile-input campaign's cases that used to end in `internal error`: each is now a one-line refusal.

A base safetensors header with a string shape or string offsets, configs nested thousands deep,
a class name carrying terminal escape codes, a target under /proc or /sys, and `test` on a file
the user may not read (a real EACCES: the command runs as an unprivileged user).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import Export, clone_export, expect_refusal

from mergeflow import errors as E

REPO = Path(__file__).resolve().parent.parent
FLUX = "FluxTransformer2DModel"


@pytest.fixture()
def ex(pristine_flux_w2: Export, tmp_path: Path) -> Export:
    """A private copy of the session's W=2 Flux checkpoint (conftest.py), free to damage."""
    return clone_export(pristine_flux_w2, tmp_path / "ck")


def _rewrite_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a safetensors file's JSON header in place (the data section is kept as it is)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return next(v for k, v in header.items() if k != "__metadata__")


def _base_weights(ex: Export) -> Path:
    return next(ex.base_dir.rglob("*.safetensors"))


HEADER_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "string shape": lambda h: _first_tensor(h).update(shape="abc"),
    "string offsets": lambda h: _first_tensor(h).update(data_offsets=["0", "16"]),
    "boolean shape": lambda h: _first_tensor(h).update(shape=[True, 3]),
    "negative shape": lambda h: _first_tensor(h).update(shape=[-4, -3]),
    "entry not an object": lambda h: h.update({next(k for k in h if k != "__metadata__"): [1, 2]}),
    # __metadata__ must map strings to strings: the safetensors library refuses anything else on load.
    "__metadata__ a list": lambda h: h.update(__metadata__=["format", "pt"]),
    "__metadata__ a string": lambda h: h.update(__metadata__="pt"),
    "__metadata__ with a number value": lambda h: h.update(__metadata__={"format": "pt", "step": 3}),
    "__metadata__ with a nested value": lambda h: h.update(__metadata__={"format": {"pt": True}}),
}


@pytest.mark.parametrize("case", sorted(HEADER_EDITS))
def test_a_malformed_base_header_is_refused(ex: Export, case: str) -> None:
    _rewrite_header(_base_weights(ex), HEADER_EDITS[case])
    err = expect_refusal(ex, E.MergeflowError, r"header", stage="inspect")
    assert "internal" not in str(err)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("where", ["checkpoint config", "fsdp_config.json", "base config"])
def test_json_nested_too_deeply_is_refused(ex: Export, where: str) -> None:
    path = {"checkpoint config": ex.actor_dir / "huggingface" / "config.json",
            "fsdp_config.json": ex.actor_dir / "fsdp_config.json",
            "base config": next(ex.base_dir.rglob("config.json"))}[where]
    path.write_text('{"a": ' + DEEP + "}")
    expect_refusal(ex, E.MergeflowError, "nested too deeply", stage="inspect")


def test_escape_codes_in_a_class_name_never_reach_the_terminal(ex: Export) -> None:
    config = ex.actor_dir / "huggingface" / "config.json"
    data = json.loads(config.read_text())
    data["_class_name"] = "\x1b[2J\x1b[HFluxTransformer\x07\x9b31m"
    config.write_text(json.dumps(data))
    err = expect_refusal(ex, E.MergeflowError, None, stage="inspect")
    assert not any(ch in str(err) for ch in "\x1b\x07\x9b"), repr(str(err))


@pytest.mark.parametrize("target", ["/proc/mergeflow-out", "/proc/self/out", "/sys/kernel/mergeflow-out"])
def test_a_target_on_a_pseudo_filesystem_is_refused(ex: Export, target: str) -> None:
    # A parent that refuses new files (/proc/<pid>) is refused by the pre-flight's first stage, before any lock;
    # a writable-looking one (/proc, /sys/kernel) when the lock is created.
    stage = "inspect" if target == "/proc/self/out" else "lock"
    err = expect_refusal(ex, E.FileAccessError, "cannot create files in", stage=stage, target=target)
    assert "/proc or /sys" in str(err)


def _as_nobody(argv: list[str]) -> tuple[int, str]:
    """`main(argv)` in a forked child that gave up root (uid/gid 65534): real permission checks apply."""
    import mergeflow.export.check.artifact_check  # noqa: F401  (imported before the fork: nobody cannot read site-packages)
    from mergeflow.flows.cli import main

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            sys.stderr = os.fdopen(write_end, "w")  # pytest has replaced sys.stderr: write to the pipe
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = main(argv)
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "r", errors="replace") as pipe:
        err = pipe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run `test` as another, unprivileged user")
def test_test_on_an_unreadable_file_is_one_line(pristine_flux_w2: Export, tmp_path: Path, prefect_api: Any) -> None:
    """A real EACCES: `mergeflow test` as nobody on an artifact with one file only root may read."""
    from mergeflow import merge_model

    published = Path(merge_model(pristine_flux_w2.config(tmp_path / "out")).output_dir)
    shared = Path(tempfile.mkdtemp(prefix="mergeflow-eacces-", dir="/tmp"))
    try:
        artifact = shared / "artifact"
        shutil.copytree(published, artifact)
        for path in [shared, *artifact.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (artifact / "config.json").chmod(0o600)
        code, err = _as_nobody(["test", "--backend", "fsdp", "--test_hf_dir", str(artifact)])
        lines = err.strip().splitlines()
        assert code == 2, err[-2000:]
        assert len(lines) == 1 and lines[0].startswith("mergeflow: error: permission denied") and "config.json" in lines[0], lines
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_the_wrong_directory_is_answered_with_where_the_checkpoint_probably_is(tmp_path: Path) -> None:
    from mergeflow.formats.verl_checkpoint import read_fsdp_config

    run = tmp_path / "run"
    for step in (100, 20):
        (run / f"global_step_{step}" / "actor").mkdir(parents=True)
        (run / f"global_step_{step}" / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}')
    dcp = tmp_path / "pytorch_model_fsdp_0"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04")
    (dcp / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    cases = {
        run / "global_step_100": f"pass --local_dir {run / 'global_step_100' / 'actor'}",
        run: f"pass --local_dir {run / 'global_step_100' / 'actor'} (the latest)",
        dcp: "is a torch Distributed Checkpoint",
        tmp_path / "absent": "does not exist",
        tmp_path / "empty": "must be verl's global_step_N/actor directory",
    }
    for path, words in cases.items():
        with pytest.raises(E.CheckpointError) as info:
            read_fsdp_config(path)
        assert words in str(info.value), (path, str(info.value))
    assert read_fsdp_config(run / "global_step_20" / "actor").world_size == 1


def test_a_base_metadata_list_is_one_line_from_the_cli_before_any_write(ex: Export, tmp_path: Path, prefect_server: Any) -> None:
    import forked_cli
    from builders import leftovers

    _rewrite_header(_base_weights(ex), lambda h: h.update(__metadata__=["format", "pt"]))
    target = tmp_path / "out"
    proc = forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model",
                                 str(ex.base_dir), "--target_dir", str(target), "--output_format", "transformer"],
                                {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mergeflow: error:") and "__metadata__" in last and "internal" not in proc.stderr, proc.stderr
    assert leftovers(tmp_path, ".out.") == [] and not target.exists()  # nothing staged, nothing published
