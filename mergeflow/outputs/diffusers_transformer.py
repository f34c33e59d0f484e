"""`--output_format transformer`: the trained transformer alone, Diffusers' model layout.

config.json and the weights at the artifact root; the base is a standalone transformer or a
pipeline's transformer folder; nothing else is copied from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from mergeflow.formats.manifest import ManifestDocument
from mergeflow.formats.model_config import ModelConfig
from mergeflow.outputs.base import BaseNeed, ModelOutput
from mergeflow.outputs.checks import (
    check_manifest_tensors,
    check_model_configs,
    check_root_class,
    check_schema_loadable,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mergeflow.architectures.registry import BaseLayout
    from mergeflow.architectures.schema import ModelSchema
    from mergeflow.config import ModelMergerConfig
    from mergeflow.export.plan.targets import TargetSchema
    from mergeflow.formats.manifest import TensorInfo
    from mergeflow.records import MergePlan

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


class DiffusersTransformer(ModelOutput):
    name: ClassVar[str] = "transformer"
    option_value: ClassVar[str] = "transformer"
    artifact_types: ClassVar[tuple[str, ...]] = ("diffusers_transformer",)
    base_need: ClassVar[BaseNeed] = "transformer"
    weights_name: ClassVar[str] = WEIGHTS_NAME  # the artifact's weights (the base's are always Diffusers')

    def target(self, config: ModelMergerConfig, base: Path, layout: BaseLayout, actor_config: ModelConfig) -> TargetSchema:
        return self.target_and_schema(config, base, layout, actor_config)[0]

    def target_and_schema(self, config: ModelMergerConfig, base: Path, layout: BaseLayout,
                          actor_config: ModelConfig) -> tuple[TargetSchema, ModelSchema]:
        """The target, and the Diffusers schema it was planned from (outputs built on this one read its fields)."""
        from mergeflow.architectures.adapters import (
            check_base_headers,
            diffusers_schema,
        )
        from mergeflow.architectures.schema import read_model_config
        from mergeflow.errors import BaseModelError
        from mergeflow.export.plan.targets import TargetSchema
        from mergeflow.formats.weight_index import read_weight_headers
        from mergeflow.io.config_paths import strip_local_paths
        from mergeflow.io.fs import FileStamp
        from mergeflow.io.session import current_session, sha256_file

        component_dir = layout.transformer_dir
        config_path = component_dir / "config.json"
        base_config = read_model_config(config_path, BaseModelError, f"{config_path.relative_to(base)} of the base")
        # Written at publish by the rule of every copied config: a local path it would keep is refused now.
        strip_local_paths(str(config_path.relative_to(base)), current_session().read_bytes(config_path), str(base))
        schema = diffusers_schema(actor_config, base_config)
        headers = read_weight_headers(component_dir, WEIGHTS_NAME, BaseModelError, "the base")
        check_base_headers(headers, schema.tensors, schema.class_name)
        rel = str(config_path.relative_to(base))
        return TargetSchema(
            architecture=schema.class_name, transformer_class=schema.class_name, component_dir=component_dir,
            tensor_directory=".", artifact_type=self.artifact_types[0], weights_name=self.weights_name,
            expected_shapes=schema.tensors, keep_fp32=schema.keep_fp32, base_files={rel: sha256_file(config_path)},
            base_stamps={str(config_path): FileStamp.of(config_path)}, output=self.name,
        ), schema

    def check_configs(self, root: Path, manifest: ManifestDocument) -> None:
        check_root_class(root, manifest)
        check_model_configs(root, manifest)

    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        return check_manifest_tensors(root, manifest)

    def check_staged(self, plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
        check_schema_loadable(plan, tensors)
