"""Our flows store their parameters exactly as Prefect would, without importing FastAPI (flows/prefect_flow.py)."""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from prefect import Flow

from mergeflow.config import ModelMergerConfig
from mergeflow.flows.backfill_flow import backfill_flow
from mergeflow.flows.checkpoint import CheckpointPayload, merge_checkpoint_flow
from mergeflow.flows.merge import merge_flow
from mergeflow.flows.prefect_flow import MergeflowFlow, json_parameter
from mergeflow.flows.smoke import smoke_flow
from mergeflow.flows.upload import upload_flow, verify_upload_flow
from mergeflow.flows.validate import validate_flow


class _Colour(enum.Enum):
    RED = "red"


def _config() -> ModelMergerConfig:
    return ModelMergerConfig(local_dir="/ckpt/global_step_3/actor", base_model="/base", target_dir="/out",
                             output_format="single_file", quantize="fp8", extract_lora=16, extract_energy=0.9,
                             workers=3, max_shard_size=123_456)


CASES: list[tuple[Any, dict[str, Any]]] = [
    (merge_flow, {"config": _config()}),
    (merge_flow, {"config": ModelMergerConfig()}),
    (validate_flow, {"test_hf_dir": "/out", "within": None, "verify_key": "/k.pub"}),
    (smoke_flow, {"test_hf_dir": "/out", "device": "cpu", "dtype": "bfloat16", "base_model": None}),
    (upload_flow, {"test_hf_dir": "/out", "hf_upload_path": "org/repo", "private": True}),
    (verify_upload_flow, {"test_hf_dir": "/out", "hf_upload_path": "org/repo", "revision": None}),
    (backfill_flow, {"train_dir": "/train", "base_model": "/base", "target_root": "/out", "checkpoint_roots": ["/a", "/b"],
                    "stable_seconds": 0.5, "dtype": "bfloat16"}),
    (merge_checkpoint_flow, {"checkpoint": CheckpointPayload(local_dir="/ckpt", run_name="r", step=3), "base_model": None}),
    # values our encoder does not take: Prefect's own path, with FastAPI
    (merge_flow, {"config": _config(), "extra": {1: "int key"}, "colour": _Colour.RED, "names": {"a"}}),
    (validate_flow, {"test_hf_dir": Path("/out"), "within": PurePosixPath("/root"), "nested": [(1, 2.5), {"x": None}]}),
]


@pytest.mark.parametrize("flow, parameters", CASES, ids=[f"{f.name}-{i}" for i, (f, _) in enumerate(CASES)])
def test_parameters_are_stored_as_prefect_stores_them(flow: MergeflowFlow, parameters: dict[str, Any]) -> None:
    assert isinstance(flow, MergeflowFlow)
    assert flow.serialize_parameters(parameters) == Flow.serialize_parameters(flow, parameters)


def test_with_options_keeps_the_class() -> None:
    copy = merge_flow.with_options(name="renamed")
    assert type(copy) is MergeflowFlow and copy.name == "renamed"


@pytest.mark.parametrize("flow", [merge_flow, backfill_flow, merge_checkpoint_flow], ids=lambda f: f.name)
def test_a_new_task_runner_gives_the_flow_prefect_would_build(flow: MergeflowFlow) -> None:
    """The copy that only swaps the task runner holds what Prefect's own with_options builds, attribute for
    attribute, and leaves the original as it was."""
    from mergeflow.flows.runners import make_task_runner

    runner = make_task_runner("thread", workers=3, dask_address=None)
    before = dict(vars(flow))
    fast = flow.with_options(task_runner=runner)
    rebuilt = Flow.with_options(flow, task_runner=runner)
    assert type(fast) is MergeflowFlow and fast is not flow and fast.task_runner is runner
    assert fast.parameters is flow.parameters  # not rebuilt: the schema is the 20 ms this saves
    assert vars(fast).keys() == vars(rebuilt).keys()
    assert {k: v for k, v in vars(fast).items() if vars(rebuilt)[k] != v} == {}
    assert vars(flow) == before and flow.task_runner is not runner


def test_unencodable_values_are_not_guessed() -> None:
    with pytest.raises(Exception, match="set"):
        json_parameter({"a": {1, 2}})


def test_a_merge_flow_call_s_parameters_do_not_import_fastapi() -> None:
    """In a fresh interpreter: encoding a merge's parameters leaves FastAPI unimported; Prefect's own path imports it."""
    code = ("import sys; from mergeflow.flows.merge import merge_flow; from mergeflow.config import ModelMergerConfig; "
            "from prefect import Flow; c = {'config': ModelMergerConfig(local_dir='/a', base_model='/b', target_dir='/c')}; "
            "merge_flow.serialize_parameters(c); ours = 'fastapi' in sys.modules; "
            "Flow.serialize_parameters(merge_flow, c); print(ours, 'fastapi' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
