"""The runtime-check flow (`mergeflow smoke`, the `smoke` deployment): run one step of a published artifact.

A published artifact is immutable: this flow reads it and reports (its return value, the CLI's JSON line
and a Prefect markdown artifact); it never rewrites the manifest or the card. A merge's --smoke records the
result in the manifest instead, before publication.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from mergeflow.export.check.artifact_check import artifact_to_check
from mergeflow.flows.heartbeats import skip_heartbeat_join
from mergeflow.flows.prefect_flow import flow
from mergeflow.flows.run_names import validate_label
from mergeflow.io.confinement import confine_read
from mergeflow.ops.smoke import check_device, runtime_markdown
from mergeflow.tasks.smoke import runtime_check_task

skip_heartbeat_join()  # a flow run ends without waiting for its heartbeat thread (flows/heartbeats.py)


def smoke_run_name() -> str:
    """`smoke-<run>-step<N>`."""
    return f"smoke-{validate_label((flow_run.parameters or {}).get('test_hf_dir'))}"


@flow(name="mergeflow-smoke", flow_run_name=smoke_run_name, validate_parameters=True)
def smoke_flow(test_hf_dir: str, device: Literal["cpu", "cuda"] = "cpu",
               dtype: Literal["float32", "bfloat16", "float16"] = "float32", base_model: str | None = None,
               trust_remote_code: bool = False, within: str | None = None,
               served_base: str | None = None) -> dict[str, Any]:
    """Load a published artifact with Diffusers and run one denoising step; report, never rewrite.

    Args:
        test_hf_dir: Absolute path of a published artifact.
        device: cpu, or cuda where the machine has one (refused otherwise).
        dtype: the dtype the model is loaded and run in.
        base_model: the local base pipeline or transformer a LoRA adapter is loaded onto.
        trust_remote_code: allow a pipeline's own code (Boogu) to load.
        within: Set by `mergeflow serve` to its target root: a run may only read below it.
        served_base: Set by `mergeflow serve` to its base model: the one base outside `within` a run may read.
    """
    check_device(device)
    if within is not None:
        test_hf_dir = confine_read(test_hf_dir, within)
        if base_model and base_model != served_base:
            base_model = confine_read(base_model, within)
    checked = artifact_to_check(test_hf_dir)
    record = runtime_check_task(str(checked), device, dtype, base_model, trust_remote_code)
    get_run_logger().info("Runtime check passed: %s, %s on %s in %s s", record["loaded_as"], record["step"],
                          record["device"], record["seconds"])
    create_markdown_artifact(markdown=runtime_markdown(record), key=f"runtime-{validate_label(checked)}",
                             description="mergeflow runtime check (one denoising step)")
    return record
