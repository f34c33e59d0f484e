"""A test-only artifact output: proves that an output is one module plus one `register_output` call.

It differs from the built-in outputs where the protocol has parts: its own manifest artifact_type,
every tensor renamed by the key-mapping hook (`toy.` + the Diffusers name), one weights file under
its own name whatever --max_shard_size says (the single-file writer), and its own `test` check
(every tensor key carries the prefix) and pre-publish check (the planned schema under the prefix).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import ManifestDocument, TensorInfo
from mergeflow.outputs.base import SINGLE_SAFETENSORS, Shape, WeightsWriter
from mergeflow.outputs.checks import check_manifest_tensors
from mergeflow.outputs.diffusers_transformer import DiffusersTransformer
from mergeflow.records import MergePlan

TOY_PREFIX = "toy."
TOY_WEIGHTS = "toy_model.safetensors"


class ToyOutput(DiffusersTransformer):
    """The trained transformer (base needs, targets and configs as `--output_format transformer`), renamed."""

    name: ClassVar[str] = "toy"
    option_value: ClassVar[str] = "toy"
    artifact_types: ClassVar[tuple[str, ...]] = ("toy_transformer",)
    weights_name: ClassVar[str] = TOY_WEIGHTS
    writer: ClassVar[WeightsWriter] = SINGLE_SAFETENSORS

    def map_tensor(self, name: str, shape: Shape) -> tuple[str, Shape]:
        return TOY_PREFIX + name, shape

    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        count = check_manifest_tensors(root, manifest, (TOY_WEIGHTS,))  # the generic checks, on the toy's file name
        odd = sorted(key for key in manifest["tensors"] if not key.startswith(TOY_PREFIX))
        if odd:
            raise ArtifactInvalidError(f"toy artifact: {odd[0]} lacks the {TOY_PREFIX!r} prefix")
        return count

    def check_staged(self, plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
        want = {TOY_PREFIX + key: list(shape) for key, shape in plan.output.expected_shapes.items()}
        if want != {key: list(info.shape) for key, info in tensors.items()}:
            raise ArtifactInvalidError("toy artifact: the staged tensors are not the planned schema under the prefix")


TOY = ToyOutput()
