"""What an export writes, decided from metadata: a standalone transformer or a whole pipeline.

Both answers are a `TargetSchema`: the schema the checkpoint must cover, where and how the
weights go, and (for pipelines) every base file with its sha256 and the files to copy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.architectures.adapters import (
    BaseWeights,
    check_base_headers,
    diffusers_schema,
)
from mergeflow.architectures.contract import check_pipeline_contract
from mergeflow.architectures.registry import BaseLayout, weights_name_for
from mergeflow.architectures.schema import read_model_config
from mergeflow.config import ModelMergerConfig
from mergeflow.errors import BaseModelError
from mergeflow.formats.manifest import ArtifactType
from mergeflow.formats.weight_index import read_weight_headers
from mergeflow.io.config_paths import strip_local_paths
from mergeflow.io.fs import FileStamp, sha256_file
from mergeflow.io.jsonfiles import JsonObject
from mergeflow.records import Conversion

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class TargetSchema:
    """The artifact an export produces and the schema it must satisfy."""

    architecture: str
    transformer_class: str
    component_dir: Path
    tensor_directory: str
    artifact_type: ArtifactType
    weights_name: str
    expected_shapes: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]
    base_files: dict[str, str]
    base_stamps: dict[str, FileStamp]
    copy_files: tuple[str, ...] = ()
    conversion: Conversion = field(default_factory=Conversion)


def transformer_target(base: Path, layout: BaseLayout, actor_config: JsonObject) -> TargetSchema:
    """`--output_format transformer`: config.json and weights at the artifact root."""
    component_dir = layout.transformer_dir
    config_path = component_dir / "config.json"
    base_config = read_model_config(config_path, BaseModelError, f"{config_path.relative_to(base)} of the base")
    # Written at publish by the rule of every copied config: a local path it would keep is refused now.
    strip_local_paths(str(config_path.relative_to(base)), config_path.read_bytes(), str(base))
    schema = diffusers_schema(actor_config, base_config)
    headers = read_weight_headers(component_dir, WEIGHTS_NAME, BaseModelError, "the base")
    check_base_headers(headers, schema.tensors, schema.class_name)
    rel = str(config_path.relative_to(base))
    return TargetSchema(
        architecture=schema.class_name, transformer_class=schema.class_name, component_dir=component_dir,
        tensor_directory=".", artifact_type="diffusers_transformer", weights_name=WEIGHTS_NAME,
        expected_shapes=schema.tensors, keep_fp32=schema.keep_fp32, base_files={rel: sha256_file(config_path)},
        base_stamps={str(config_path): FileStamp.of(config_path)},
    )


def hash_base_files(base: Path, files: tuple[str, ...], workers: int) -> dict[str, str]:
    """sha256 of every base file, largest first across a few threads (hashlib releases the GIL)."""
    ordered = sorted(files, key=lambda rel: -(base / rel).stat().st_size)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = dict(zip(ordered, pool.map(lambda rel: sha256_file(base / rel), ordered)))
    return dict(sorted(digests.items()))


def pipeline_target(config: ModelMergerConfig, base: Path, actor_config: JsonObject) -> TargetSchema:
    """`--output_format pipeline`: the contract, the trained component's schema, every base file hashed."""
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
        base_stamps={str(base / rel): FileStamp.of(base / rel) for rel in contract.files},
        copy_files=contract.copy_files, conversion=conversion,
    )
