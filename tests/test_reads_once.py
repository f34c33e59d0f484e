"""Plan once: during a real merge through the command line (pre-flight, then the flow), each metadata file
of the checkpoint and of the base is opened exactly once, counted by Python's audit hook ("open" events),
and each planning check runs once, counted by a profile hook.

What "read once" means for the other files: a checkpoint's data files (rank files, `.distcp`) are opened
by the hash pass and by the readers of their tensors, and a base's safetensors by the schema step, the
hash of its files and the unchanged-weights guard's sampling: those are data reads with their own
purposes, not planning, so only the metadata files are held to exactly one open. A pipeline's copied
components (vae/, text_encoder/, scheduler/, ...) are checked at planning and copied at the end, so
their configs are counted only for the trained component (its config.json and weight index).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import make_export

METADATA_NAMES = ("config.json", "fsdp_config.json", ".metadata", "model_index.json", "lora_train_meta.json",
                  "adapter_config.json")

_OPENS: collections.Counter[str] = collections.Counter()
_ROOTS: list[str] = []


def _count_opens(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _ROOTS and isinstance(args[0], (str, Path)):
        path = str(args[0])
        if path.startswith(tuple(_ROOTS)):
            _OPENS[path] += 1


sys.addaudithook(_count_opens)  # hooks cannot be removed: it counts only while _ROOTS names directories


@pytest.fixture()
def opens() -> Iterator[collections.Counter[str]]:
    _OPENS.clear()
    yield _OPENS
    _ROOTS.clear()


def _is_metadata(path: str) -> bool:
    return Path(path).name in METADATA_NAMES or path.endswith(".index.json")


def _merge(args: list[str], roots: list[Path], opens: collections.Counter[str]) -> dict[str, int]:
    from mergeflow.deployments.cli import main

    _ROOTS[:] = [str(r.resolve()) for r in roots]
    try:
        assert main(["merge", "--backend", "fsdp", *args]) == 0
    finally:
        _ROOTS.clear()
    metadata = {path: n for path, n in opens.items() if _is_metadata(path)}
    assert metadata, "the hook saw no metadata file: it counts nothing"
    return metadata


def _assert_once(metadata: dict[str, int]) -> None:
    assert {path: n for path, n in metadata.items() if n != 1} == {}, json.dumps(metadata, indent=1)


def test_a_transformer_export_opens_each_metadata_file_once(tmp_path: Path, prefect_api: object,
                                                            opens: collections.Counter[str]) -> None:
    ex = make_export(tmp_path / "x", world_size=2)
    metadata = _merge(["--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
                       "--target_dir", str(tmp_path / "out"), "--output-format", "transformer"],
                      [ex.actor_dir, ex.base_dir], opens)
    assert {Path(p).name for p in metadata} >= {"config.json", "fsdp_config.json"}
    _assert_once(metadata)
    for rank in range(2):  # the rank files: parsed for their keys and hashed, each once
        assert opens[str(ex.actor_dir.resolve() / f"model_world_size_2_rank_{rank}.pt")] >= 1


def test_a_dcp_pipeline_export_opens_each_metadata_file_once(tmp_path: Path, prefect_api: object,
                                                             opens: collections.Counter[str]) -> None:
    """A torch DCP (its pickled .metadata) into a sharded pipeline (model_index.json, the weight index)."""
    import shutil

    from mergeflow.demo.checkpoints import build_transformer
    from mergeflow.demo.pipeline import build_qwenimage_base
    from tests.fixtures.dcp_writers import write_dcp_checkpoint

    ckpt = write_dcp_checkpoint(tmp_path / "dcp", class_name="QwenImageTransformer2DModel", world_size=2, prefix="model.")
    base = build_qwenimage_base(tmp_path / "pipeline", build_transformer(ckpt.class_name, seed=0))
    config_dir = tmp_path / "model_config"
    config_dir.mkdir()
    shutil.copy(base / "transformer" / "config.json", config_dir / "config.json")
    metadata = _merge(["--local_dir", str(ckpt.dcp_dir), "--base_model", str(base), "--target_dir", str(tmp_path / "out"),
                       "--output-format", "pipeline", "--hf_model_config_path", str(config_dir), "--max_shard_size", "4096"],
                      [ckpt.dcp_dir, config_dir, base / "model_index.json", base / "transformer"], opens)
    assert {Path(p).name for p in metadata} >= {".metadata", "config.json", "model_index.json"}
    _assert_once(metadata)


def test_a_lora_adapter_export_opens_each_metadata_file_once(tmp_path: Path, prefect_api: object,
                                                             opens: collections.Counter[str]) -> None:
    """A LoRA-only save exported as its adapter, its base local (checked, not merged)."""
    from lora_builders import build_lora_checkpoint
    from test_lora_export import plain_config

    ck = build_lora_checkpoint(tmp_path / "lora", "FluxTransformer2DModel", plain_config("FluxTransformer2DModel"),
                               world_size=2, layout="lora_only")
    metadata = _merge(["--local_dir", str(ck.actor_dir), "--base_model", str(ck.base_dir),
                       "--target_dir", str(tmp_path / "out"), "--output-format", "transformer"], [ck.actor_dir, ck.base_dir], opens)
    assert {Path(p).name for p in metadata} >= {"config.json", "fsdp_config.json", "lora_train_meta.json"}
    _assert_once(metadata)


def test_a_merge_runs_each_planning_check_once(tmp_path: Path, prefect_api: object) -> None:
    """Counted by code object in every thread of a real CLI merge: the option check, the base's layout and the
    path checks run once; the target check runs once more under the target lock (another export may have
    published the target since planning: that is the race the lock settles, not a second plan)."""
    import threading
    from types import FrameType

    from mergeflow.architectures.registry import detect_base
    from mergeflow.config import ModelMergerConfig
    from mergeflow.deployments.cli import main
    from mergeflow.export.plan.input_checks import _resolve_inputs
    from mergeflow.export.plan.preflight import _stage_one
    from mergeflow.io.staging import check_target

    watched = {f.__code__: f.__qualname__ for f in (ModelMergerConfig.validate, detect_base, _resolve_inputs, _stage_one,
                                                     check_target)}
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in watched:
            calls[watched[frame.f_code]] += 1

    ex = make_export(tmp_path / "x", world_size=2)
    threading.setprofile(profile)  # the task threads Prefect starts from now on
    sys.setprofile(profile)
    try:
        assert main(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model", str(ex.base_dir),
                     "--target_dir", str(tmp_path / "out"), "--output-format", "transformer"]) == 0
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert dict(calls) == {"ModelMergerConfig.validate": 1, "detect_base": 1, "_resolve_inputs": 1, "_stage_one": 1,
                           "check_target": 2}, dict(calls)
