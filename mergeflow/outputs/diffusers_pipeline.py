"""`--output_format pipeline` (the default): the whole Diffusers pipeline with the trained component.

The base is a local pipeline; its contract (mergeflow.architectures.contract) fixes the files
copied from it, the ones left out and the config changes. An architecture may name its own
artifact_type (MiniMax H3's native layout: `minimax_h3_pipeline`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from mergeflow.architectures.contract import check_pipeline_artifact
from mergeflow.architectures.registry import PIPELINES
from mergeflow.errors import UsageError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.formats.model_config import ModelConfig
from mergeflow.outputs.base import BaseNeed, ModelOutput
from mergeflow.outputs.checks import (
    check_manifest_tensors,
    check_model_configs,
    check_schema_loadable,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mergeflow.architectures.registry import Architecture, BaseLayout
    from mergeflow.config import ModelMergerConfig
    from mergeflow.export.plan.targets import TargetSchema
    from mergeflow.formats.manifest import TensorInfo
    from mergeflow.records import MergePlan


def _architecture(layout: BaseLayout) -> Architecture | None:
    return PIPELINES.get(layout.class_name) if layout.kind == "pipeline" else None


class DiffusersPipeline(ModelOutput):
    name: ClassVar[str] = "pipeline"
    option_value: ClassVar[str] = "pipeline"
    # Each architecture names its pipeline artifact's type (diffusers_pipeline unless it says otherwise).
    artifact_types: ClassVar[tuple[str, ...]] = tuple(dict.fromkeys(a.artifact_type for a in PIPELINES.values()))
    base_need: ClassVar[BaseNeed] = "pipeline"

    def check_component(self, config: ModelMergerConfig, layout: BaseLayout) -> None:
        arch = _architecture(layout)
        if arch is not None and config.component not in arch.trainable:
            raise UsageError(f"--component {config.component}: a {arch.pipeline_class} checkpoint can replace "
                             f"{', '.join(arch.trainable)}")

    def compares_classes(self, config: ModelMergerConfig, layout: BaseLayout) -> bool:
        arch = _architecture(layout)  # a remote-code or converted component is checked by its adapter
        return arch is not None and arch.adapter.instantiates_model

    def target(self, config: ModelMergerConfig, base: Path, layout: BaseLayout, actor_config: ModelConfig) -> TargetSchema:
        """The contract, the trained component's schema, every base file hashed."""
        from mergeflow.architectures.adapters import BaseWeights
        from mergeflow.architectures.contract import check_pipeline_contract
        from mergeflow.architectures.registry import weights_name_for
        from mergeflow.architectures.schema import read_model_config
        from mergeflow.errors import BaseModelError
        from mergeflow.export.plan.targets import TargetSchema, hash_base_files
        from mergeflow.formats.weight_index import read_weight_headers
        from mergeflow.io.fs import FileStamp
        from mergeflow.records import Conversion

        contract = check_pipeline_contract(base, component=config.component, trust_remote_code=config.trust_remote_code)
        arch = contract.architecture
        component_dir = base / config.component
        spec = arch.spec(config.component)
        assert spec is not None  # the contract checked the trained component
        weights_name = weights_name_for(spec, contract.components[config.component][0])
        base_config = read_model_config(component_dir / "config.json", BaseModelError, f"{config.component}/config.json of the base")
        weights = BaseWeights(str(component_dir), weights_name, read_weight_headers(component_dir, weights_name, BaseModelError, "the base"))
        trained = arch.adapter.trained_schema(actor_config, base_config, weights, qkv_layout=config.qkv_layout,
                                              what=config.component)
        conversion = Conversion(adapter=trained.adapter, adapter_params=trained.adapter_params,
                                output_shapes=trained.output_shapes, config_changes=contract.config_changes,
                                not_copied=contract.excluded)
        return TargetSchema(
            architecture=arch.pipeline_class, transformer_class=trained.transformer_class, component_dir=component_dir,
            tensor_directory=config.component, artifact_type=arch.artifact_type, weights_name=weights_name,
            expected_shapes=trained.expected_shapes, keep_fp32=trained.keep_fp32, base_files=hash_base_files(base, contract.files, config.workers),
            base_stamps={str(base / rel): FileStamp.of(base / rel) for rel in contract.files}, output=self.name,
            copy_files=contract.copy_files, conversion=conversion,
        )

    def check_configs(self, root: Path, manifest: ManifestDocument) -> None:
        check_pipeline_artifact(root, manifest)  # the (modular) model_index.json and every declared component
        check_model_configs(root, manifest)

    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        return check_manifest_tensors(root, manifest)

    def check_staged(self, plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
        check_schema_loadable(plan, tensors)
