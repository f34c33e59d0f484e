"""What an export writes, decided from metadata: a standalone transformer or a whole pipeline.

Both answers are an `OutputTarget`: the schema the checkpoint must cover, where and how the
weights go, and (for pipelines) every base file with its sha256 and the files to copy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergeflow.architectures import BaseLayout, weights_name_for
from mergeflow.config import ModelMergerConfig
from mergeflow.errors import BaseModelError, CheckpointError, SchemaMismatchError
from mergeflow.fsops import FileStamp, sha256_file
from mergeflow.pipeline_contract import check_pipeline_contract
from mergeflow.schema import ModelSchema, base_weight_headers, model_schema, read_model_config

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class OutputTarget:
    """The artifact an export produces and the schema it must satisfy."""

    architecture: str
    transformer_class: str
    component_dir: Path
    tensor_directory: str
    artifact_type: str
    weights_name: str
    expected_shapes: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]
    base_files: dict[str, str]
    base_stamps: dict[str, FileStamp]
    copy_files: tuple[str, ...] = ()
    extras: dict[str, Any] = field(default_factory=dict)


def diffusers_schema(actor_config: dict[str, Any], base_config: dict[str, Any]) -> ModelSchema:
    """Same Diffusers class, equal constructor fields (defaults filled in); the base meta module's schema."""
    actor_class, base_class = actor_config.get("_class_name"), base_config.get("_class_name")
    if not isinstance(actor_class, str):
        raise CheckpointError("huggingface/config.json of the checkpoint has no _class_name")
    if actor_class != base_class:
        raise SchemaMismatchError(f"the checkpoint is a {actor_class} but the base transformer is a {base_class}")
    actor, base = model_schema(actor_class, actor_config), model_schema(actor_class, base_config)
    diffs = actor.differences(base)
    if diffs:
        raise SchemaMismatchError(f"checkpoint and base configs differ on {len(diffs)} field(s): {'; '.join(diffs[:3])}")
    return base


def _check_headers(headers: dict[str, tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], what: str) -> None:
    if {k: tuple(v[1]) for k, v in headers.items()} != {k: tuple(v) for k, v in expected.items()}:
        raise BaseModelError(f"the base's {what} weights do not match its own config.json; the base is damaged")


def transformer_target(base: Path, layout: BaseLayout, actor_config: dict[str, Any]) -> OutputTarget:
    """`--output_format transformer`: config.json and weights at the artifact root."""
    component_dir = layout.transformer_dir
    config_path = component_dir / "config.json"
    base_config = read_model_config(config_path, BaseModelError, f"{config_path.relative_to(base)} of the base")
    schema = diffusers_schema(actor_config, base_config)
    _check_headers(base_weight_headers(component_dir, weights_name=WEIGHTS_NAME), schema.tensors, schema.class_name)
    rel = str(config_path.relative_to(base))
    return OutputTarget(
        architecture=schema.class_name, transformer_class=schema.class_name, component_dir=component_dir,
        tensor_directory=".", artifact_type="diffusers_transformer", weights_name=WEIGHTS_NAME,
        expected_shapes=schema.tensors, keep_fp32=schema.keep_fp32, base_files={rel: sha256_file(config_path)},
        base_stamps={str(config_path): FileStamp.of(config_path)},
    )


def remote_code_schema(actor_config: dict[str, Any], base_config: dict[str, Any],
                       headers: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """A class we may not run: same class, identical config fields, and the base's own weight headers."""
    if actor_config.get("_class_name") != base_config.get("_class_name"):
        raise SchemaMismatchError(f"the checkpoint is a {actor_config.get('_class_name')} "
                                  f"but the base transformer is a {base_config.get('_class_name')}")
    actor = {k: v for k, v in actor_config.items() if not k.startswith("_")}
    base = {k: v for k, v in base_config.items() if not k.startswith("_")}
    diffs = sorted(k for k in set(actor) | set(base) if actor.get(k, "<absent>") != base.get(k, "<absent>"))
    if diffs:
        shown = "; ".join(f"{k}: checkpoint {actor.get(k, '<absent>')!r} vs base {base.get(k, '<absent>')!r}" for k in diffs[:3])
        raise SchemaMismatchError(f"checkpoint and base configs differ on {len(diffs)} field(s): {shown}")
    return {k: tuple(shape) for k, (_, shape) in headers.items()}


def stored_tensor(component_dir: Path, weights_name: str, key: str) -> torch.Tensor | None:
    """One tensor of a base's weights (single file or indexed), or None when absent."""
    import json

    from safetensors import safe_open

    single, index = component_dir / weights_name, component_dir / f"{weights_name}.index.json"
    file_name = weights_name if single.is_file() else json.loads(index.read_text()).get("weight_map", {}).get(key)
    if file_name is None:
        return None
    with safe_open(str(component_dir / file_name), framework="pt") as handle:
        return handle.get_tensor(key) if key in handle.keys() else None


def hash_base_files(base: Path, files: tuple[str, ...], workers: int) -> dict[str, str]:
    """sha256 of every base file, largest first across a few threads (hashlib releases the GIL)."""
    ordered = sorted(files, key=lambda rel: -(base / rel).stat().st_size)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = dict(zip(ordered, pool.map(lambda rel: sha256_file(base / rel), ordered)))
    return dict(sorted(digests.items()))


def pipeline_target(config: ModelMergerConfig, base: Path, actor_config: dict[str, Any]) -> OutputTarget:
    """`--output_format pipeline`: the contract, the trained component's schema, every base file hashed."""
    contract = check_pipeline_contract(base, component=config.component, trust_remote_code=config.trust_remote_code)
    arch = contract.architecture
    component_dir = base / config.component
    spec = arch.spec(config.component)
    assert spec is not None  # the contract checked the trained component
    weights_name = weights_name_for(spec, contract.components[config.component][0])
    base_config = read_model_config(component_dir / "config.json", BaseModelError, f"{config.component}/config.json of the base")
    headers = base_weight_headers(component_dir, weights_name=weights_name)
    extras: dict[str, Any] = {"config_changes": contract.config_changes, "not_copied": contract.excluded}
    transformer_class = str(actor_config.get("_class_name"))
    if arch.schema == "minimax_h3_native":
        from mergeflow.adapters.minimax_h3 import INV_FREQ, check_native_base

        stored = stored_tensor(component_dir, weights_name, INV_FREQ)
        expected, keep, params, native = check_native_base(actor_config, base_config, headers, stored, config.qkv_layout)
        extras.update(adapter="minimax_h3_native", adapter_params=params, output_shapes=native)
    elif arch.schema == "remote_code":
        expected, keep = remote_code_schema(actor_config, base_config, headers), ()
        extras["output_shapes"] = expected  # the class is never run here, so no meta instantiation checks it
    else:
        schema = diffusers_schema(actor_config, base_config)
        expected = schema.tensors
        _check_headers(headers, expected, f"{config.component} ({schema.class_name})")
        keep, transformer_class = schema.keep_fp32, schema.class_name
    return OutputTarget(
        architecture=arch.pipeline_class, transformer_class=transformer_class, component_dir=component_dir,
        tensor_directory=config.component, artifact_type=arch.artifact_type, weights_name=weights_name,
        expected_shapes=expected, keep_fp32=keep, base_files=hash_base_files(base, contract.files, config.workers),
        base_stamps={str(base / rel): FileStamp.of(base / rel) for rel in contract.files},
        copy_files=contract.copy_files, extras=extras,
    )
