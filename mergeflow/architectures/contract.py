"""The pipeline contract (SPEC section 3): is this base complete, known and safe to copy?

Checked from metadata before any heavy work. The answer lists every base file, the files that
go into the artifact unchanged (or with local-path keys removed), and what is left out and why.
The same module checks a published pipeline artifact for `test`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mergeflow.architectures.registry import (
    INDEX_FILES,
    KNOWN_LIBRARIES,
    MODEL,
    PROCESSOR,
    SCHEDULER,
    TOKENIZER,
    Architecture,
    ComponentSpec,
    architecture_of,
    declared_entry,
    read_index,
    weights_name_for,
)
from mergeflow.errors import ArtifactInvalidError, BaseModelError, UsageError
from mergeflow.formats.manifest import MANIFEST_NAME, ManifestDocument
from mergeflow.formats.model_config import ModelConfig, PipelineIndex
from mergeflow.formats.weight_index import read_weights
from mergeflow.io.config_paths import is_config_json, strip_local_paths
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.io.paths import check_relative_name
from mergeflow.io.session import current_session

# Tool state beside a model, not part of it (`hf download --local-dir` writes .cache/huggingface).
SKIPPED_TOP_DIRS = {".cache": "download tool state", ".git": "version-control metadata"}
VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model")
PROCESSOR_CONFIGS = ("processor_config.json", "preprocessor_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_REPLACED = "weights of the trained component, replaced by the checkpoint's"


@dataclass(frozen=True)
class PipelineContract:
    """A base pipeline that passed the contract, and what its export copies."""

    architecture: Architecture
    index_file: str
    components: dict[str, tuple[str, str]]  # every declared (non-null) component -> (library, class)
    files: tuple[str, ...]  # every file of the base pipeline (relative POSIX paths, sorted)
    copy_files: tuple[str, ...]  # the files copied into the artifact
    excluded: dict[str, str]  # base path -> why it is not part of the artifact
    config_changes: dict[str, list[str]]  # copied config -> local-path keys removed from it


def walk_base(base_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Every plain file of the base (sorted), refusing symlinks and special files; skipped tool dirs."""
    files: list[str] = []
    excluded: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(base_dir):
        here = Path(dirpath)
        for name in sorted(dirnames):
            rel = (here / name).relative_to(base_dir).as_posix()
            if here == base_dir and name in SKIPPED_TOP_DIRS:
                dirnames.remove(name)
                excluded[f"{rel}/"] = SKIPPED_TOP_DIRS[name]
            elif (here / name).is_symlink():
                what = "component directory" if here == base_dir else "directory"
                raise BaseModelError(f"{what} {rel}/ of the base is a symlink; copy it in place (mergeflow never follows links)")
        for name in filenames:
            path = here / name
            rel = path.relative_to(base_dir).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise BaseModelError(
                    f"{rel} of the base is a symlink (a Hugging Face cache snapshot?); use a plain copy, "
                    "e.g. `hf download ORG/REPO --local-dir DIR`"
                )
            if not stat.S_ISREG(mode):
                raise BaseModelError(f"{rel} of the base is not a regular file")
            check_relative_name(rel, "base file")
            files.append(rel)
    return sorted(files), excluded


def _config(path: Path, rel: str) -> ModelConfig:
    data = read_json_strict(path, BaseModelError, f"{rel} of the base")
    if not isinstance(data, dict):
        raise BaseModelError(f"{rel} of the base must be a JSON object")
    return data


def _refuse_remote_or_quantized(data: ModelConfig, rel: str) -> None:
    if "auto_map" in data:
        raise BaseModelError(f"{rel} of the base has an auto_map (Hub remote code); such components are not supported")
    if "quantization_config" in data:
        raise BaseModelError(f"{rel} of the base is quantized (quantization_config); export onto a full-precision base")


def _check_model(base_dir: Path, name: str, library: str, class_name: str, spec: ComponentSpec) -> None:
    config = _config(base_dir / name / "config.json", f"{name}/config.json")
    _refuse_remote_or_quantized(config, f"{name}/config.json")
    named = config.get("_class_name")
    if library != "transformers" and named is not None and named != class_name:
        raise BaseModelError(f"{name}/config.json names {named!r}, but the base index declares {class_name!r}")
    read_weights(base_dir / name, weights_name_for(spec, library), BaseModelError, "the base")  # headers only, no torch


def _check_component(base_dir: Path, name: str, library: str, class_name: str, spec: ComponentSpec) -> None:
    """One declared component: present, with what its kind needs, in the accepted naming."""
    folder = base_dir / name
    if not folder.is_dir():
        raise BaseModelError(f"the base index declares component {name!r} but {name}/ is missing; the base is incomplete")
    if spec.library is not None and library != spec.library:
        raise BaseModelError(f"component {name!r} must come from library {spec.library!r}, the base index says {library!r}")
    if library not in KNOWN_LIBRARIES and not (folder / f"{library}.py").is_file():
        raise BaseModelError(f"component {name!r} names library {library!r}, which is neither known nor a module {name}/{library}.py")
    if spec.kind == MODEL:
        _check_model(base_dir, name, library, class_name, spec)
    elif spec.kind == SCHEDULER:
        config = _config(folder / "scheduler_config.json", f"{name}/scheduler_config.json")
        if config.get("_class_name") != class_name:
            raise BaseModelError(
                f"{name}/scheduler_config.json names {config.get('_class_name')!r}, but the base index declares {class_name!r}"
            )
    elif spec.kind == TOKENIZER:
        if not any((folder / v).is_file() for v in VOCAB_FILES):
            raise BaseModelError(f"tokenizer {name}/ has no vocabulary file (one of {', '.join(VOCAB_FILES)}); the base is incomplete")
        if (folder / "tokenizer_config.json").is_file():
            _refuse_remote_or_quantized(_config(folder / "tokenizer_config.json", f"{name}/tokenizer_config.json"), f"{name}/tokenizer_config.json")
    elif spec.kind == PROCESSOR:
        present = [c for c in PROCESSOR_CONFIGS if (folder / c).is_file()]
        if not present:
            raise BaseModelError(f"processor {name}/ has no {' or '.join(PROCESSOR_CONFIGS)}; the base is incomplete")
        for config_name in present:
            _refuse_remote_or_quantized(_config(folder / config_name, f"{name}/{config_name}"), f"{name}/{config_name}")


def _check_options(arch: Architecture, index: PipelineIndex, components: dict[str, tuple[str, str]]) -> None:
    """Primitive pipeline options that must make sense (Wan2.2's expert switch)."""
    if "boundary_ratio" in arch.options:
        ratio = index.get("boundary_ratio")
        if ratio is None and "transformer_2" in components:
            raise BaseModelError("model_index.json has transformer_2 but no boundary_ratio; Wan2.2 needs one in (0, 1)")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
            raise BaseModelError(f"model_index.json boundary_ratio must be a number in (0, 1), not {ratio!r}")
    if "expand_timesteps" in arch.options and "expand_timesteps" in index:
        if not isinstance(index["expand_timesteps"], bool):
            raise BaseModelError(f"model_index.json expand_timesteps must be true or false, not {index['expand_timesteps']!r}")


def declared_components(arch: Architecture, index: PipelineIndex, index_file: str) -> dict[str, tuple[str, str]]:
    """Every non-null component the index declares; unknown components are refused."""
    out: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, (list, tuple)):
            continue
        entry = declared_entry(index, name)
        if entry is None:
            continue
        if arch.spec(name) is None:
            known = ", ".join(sorted({**arch.components, **arch.optional_components}))
            raise BaseModelError(f"{index_file} declares component {name!r}, unknown for {arch.pipeline_class} (known: {known})")
        out[name] = entry
    return out


def _trained_files(files: list[str], component: str) -> dict[str, str]:
    """The trained component's config and weight files: the export writes its own instead."""
    out = {f"{component}/config.json": "config of the trained component, rewritten from the base's"}
    for rel in files:
        folder, _, name = rel.rpartition("/")
        if folder == component and (name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")):
            out[rel] = _REPLACED
    return out


def check_pipeline_contract(base_dir: Path, *, component: str, trust_remote_code: bool) -> PipelineContract:
    """Check a base pipeline against SPEC section 3 and list the files its export copies."""
    found = read_index(base_dir)
    if found is None:
        raise UsageError("--output_format pipeline needs a base pipeline (a directory with model_index.json); "
                         "use --output_format transformer for a standalone transformer base")
    index_file, index = found
    arch = architecture_of(index.get("_class_name"), index_file)
    files, excluded = walk_base(base_dir)
    code = [f for f in files if f.endswith(".py")]
    if code and not trust_remote_code:
        raise BaseModelError(
            f"the base contains Python code ({', '.join(code[:3])}); copying code into the artifact needs --trust-remote-code"
        )
    components = declared_components(arch, index, index_file)
    if component not in arch.trainable:
        raise UsageError(f"--component {component}: a {arch.pipeline_class} checkpoint can replace {', '.join(arch.trainable)}")
    if component not in components:
        raise BaseModelError(f"the base pipeline {arch.pipeline_class} declares no component {component!r}")
    if components[component][1] != arch.declared_class:
        raise BaseModelError(f"{index_file} declares {component} as {components[component][1]!r}, expected {arch.declared_class!r}")
    for name, (library, class_name) in sorted(components.items()):
        spec = arch.spec(name)
        assert spec is not None  # declared_components refused unknown names
        _check_component(base_dir, name, library, class_name, spec)
    _check_options(arch, index, components)
    trained = _trained_files(files, component)
    if MANIFEST_NAME in files:
        trained[MANIFEST_NAME] = "manifest of the base's own export, replaced by this export's"
    if "README.md" in files:  # the model card (mergeflow/hub/model_card.py) is the export's own
        trained["README.md"] = "the base's model card, replaced by this export's"
    copy_files = tuple(f for f in files if f not in trained)
    excluded.update({rel: why for rel, why in trained.items() if rel in files})
    changes = {}
    for rel in copy_files:
        if is_config_json(rel):
            _, removed = strip_local_paths(rel, current_session().read_bytes(base_dir / rel), str(base_dir))
            if removed:
                changes[rel] = removed
    # The trained config.json is written at publish by the same rule: a local path it would keep
    # is refused now, not after every shard is written.
    strip_local_paths(f"{component}/config.json", current_session().read_bytes(base_dir / component / "config.json"), str(base_dir))
    return PipelineContract(arch, index_file, components, tuple(files), copy_files, excluded, changes)


def check_pipeline_artifact(root: Path, manifest: ManifestDocument) -> None:
    """`test` for pipelines: the index agrees with the manifest and every declared component is there."""
    index_file, index = read_index_for_test(root)
    if index.get("_class_name") != manifest["architecture"]:
        raise ArtifactInvalidError(f"{index_file} names {index.get('_class_name')!r}, but the manifest says {manifest['architecture']!r}")
    trained = manifest["tensor_directory"]
    if manifest["trained_components"] != [trained]:
        raise ArtifactInvalidError(f"manifest trained_components {manifest['trained_components']} disagree with tensor_directory {trained!r}")
    listed = {rel.split("/", 1)[0] for rel in manifest["files"] if "/" in rel}
    declared = set()
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, (list, tuple)) or len(value) not in (2, 3):
            continue
        if value[0] is None and value[1] is None:
            continue
        declared.add(name)
        if name not in listed or not (root / name).is_dir():
            raise ArtifactInvalidError(f"{index_file} declares component {name!r}, but the artifact has no {name}/")
    if trained not in declared:
        raise ArtifactInvalidError(f"{index_file} does not declare the trained component {trained!r}")


def read_index_for_test(root: Path) -> tuple[str, PipelineIndex]:
    """The artifact's pipeline index, read strictly; a pipeline artifact without one is invalid."""
    for name in INDEX_FILES:
        if (root / name).is_file():
            data = read_json_strict(root / name, ArtifactInvalidError, name)
            if not isinstance(data, dict):
                raise ArtifactInvalidError(f"{name} must be a JSON object")
            return name, data
    raise ArtifactInvalidError("a pipeline artifact needs model_index.json (or modular_model_index.json)")
