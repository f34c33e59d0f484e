"""merge_manifest.json: building it from records and checking its schema strictly."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, NotRequired, TypedDict

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.safetensors_format import DTYPES
from mergeflow.io.paths import check_relative_name
from mergeflow.io.ranges import RANGE_ALIGN, FileRanges, range_count

MANIFEST_NAME = "merge_manifest.json"
SCHEMA_VERSION = 1
# The kind of artifact; its values are those of the registered outputs (mergeflow.outputs.registry).
ArtifactType = str
# Optional: present only when the unchanged-weights guard compared every tensor with the base (the
# sample matched), so an ordinary export's manifest is byte-identical to one written without the guard.
UNCHANGED_CHECK = "unchanged_check"
# source_model_config.logical_path: where the exported model config came from, named without a local
# path. A verl checkpoint saves its own; a DCP carries none, so it is the flag's file or the base's.
VERL_CONFIG_PATH = "huggingface/config.json"
FLAG_CONFIG_PATH = "hf_model_config_path/config.json"
BASE_CONFIG_PREFIX = "base_model/"
VERIFICATION_LAYERS = ("structure", "source_round_trip", "artifact_round_trip", "integrity")
# Optional: per-range digests of the large files, so `test` can hash one file on every core
# (mergeflow/io/ranges.py). Absent when no file is large, so a small export's manifest is unchanged.
FILE_RANGES = "file_ranges"

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "artifact_type": str,
    "architecture": str,
    "backend": str,
    "trained_components": list,
    "tensor_directory": str,
    "dtype": str,
    "max_shard_size_bytes": int,
    "source_files": dict,
    "source_model_config": dict,
    "source_fingerprint": str,
    "base_files": dict,
    "base_fingerprint": str,
    "files": dict,
    "tensors": dict,
    "config_transform": dict,
    "producer": dict,
    "verification": dict,
}


def fingerprint(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_LEAVES = (str, int, float, bool, type(None))


def plain(obj: Any) -> Any:
    """What `dataclasses.asdict` gives for a record (equal, the same container types), without its deep copy of
    every leaf. The shard and adapter fingerprints hash this for every write of a plan: for the 1,156 writes of
    a Flux transformer from 8 ranks, asdict took 40-43 ms and this 17 ms (2026-12-08, one core)."""
    cls = type(obj)
    if cls in _LEAVES:
        return obj
    names = _FIELD_NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELD_NAMES.setdefault(cls, tuple(f.name for f in dataclasses.fields(obj)))
    if names is not None:
        return {name: plain(getattr(obj, name)) for name in names}
    if cls is tuple or cls is list:
        return cls([plain(v) for v in obj])
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple, rebuilt field by field as asdict does
        return cls(*[plain(v) for v in obj])
    if isinstance(obj, (list, tuple)):
        return cls(plain(v) for v in obj)
    if isinstance(obj, dict):
        return cls((plain(k), plain(v)) for k, v in obj.items())
    return copy.deepcopy(obj)


@functools.cache
def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, or None. Read once per process: each lookup scans sys.path and
    parses the package's METADATA (the manifest's eight took 3.6 ms), a merge asked up to eleven times, and the
    code a process runs is the one it imported, whatever is installed later."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def producer_versions() -> dict[str, str]:
    versions = {}
    for dist in ("mergeflow", "torch", "diffusers", "transformers", "safetensors", "peft", "prefect", "huggingface_hub"):
        found = installed_version(dist)
        if found is not None:
            versions[dist] = found
    return versions


class TensorJson(TypedDict):
    """`tensors[name]` as written: the shape as a list."""

    shape: list[int]
    dtype: str


class CheckpointRecord(TypedDict, total=False):
    """`checkpoint`: the checkpoint source's own record (mergeflow.sources); each source writes its keys in its order."""

    layout: str  # a torch DCP only
    world_size: int
    fsdp_version: int  # verl rank files only


class LoraAdapterJson(TypedDict):
    """`lora_adapter` as written (`LoraAdapterRecord.to_json`)."""

    adapter_name: str
    format: str
    base_model_name_or_path: str | None
    layout: str
    r: int
    lora_alpha: float
    target_modules: list[str]
    excluded_adapters: list[str]
    settings_source: str


class FileRangesJson(TypedDict):
    """`file_ranges[path]` as written: the sha256 of each consecutive `range_size` bytes of a `size`-byte file."""

    size: int
    range_size: int
    sha256: list[str]


class ManifestDocument(TypedDict):
    """merge_manifest.json as a JSON document: what `Manifest.to_json` writes and `check_manifest` accepts.

    `test` reads it back from the artifact (no `Manifest` record exists there); each key's type is
    checked by `check_manifest` before any output's checks read it.
    """

    schema_version: int
    artifact_type: ArtifactType
    architecture: str
    backend: str
    trained_components: list[str]
    tensor_directory: str
    dtype: str
    max_shard_size_bytes: int
    source_files: dict[str, str]
    source_model_config: dict[str, str]  # sha256, logical_path
    source_fingerprint: str
    base_files: dict[str, str]
    base_fingerprint: str
    files: dict[str, str]
    tensors: dict[str, TensorJson]
    config_transform: dict[str, Any]  # ConfigTransform.to_json
    producer: dict[str, str]
    verification: dict[str, str]
    checkpoint: NotRequired[CheckpointRecord]
    lora_fusion: NotRequired[dict[str, Any]]  # LoraFusion.to_json
    lora_adapter: NotRequired[LoraAdapterJson]
    unchanged_check: NotRequired[dict[str, int]]  # UnchangedMeasurement's counts
    original_layout: NotRequired[dict[str, Any]]  # a single file's key map (mergeflow/outputs/single_file.py)
    # Encoded weights: {method, kept_f32/excluded: [...], tensors: {key: {...}}} (GGUF: mergeflow/outputs/gguf.py).
    quantization: NotRequired[dict[str, Any]]
    # The model card (README.md): {file, base_model, base_model_relation, tensors_sha256} (mergeflow/hub/model_card.py).
    model_card: NotRequired[dict[str, Any]]
    # The runtime check's measurement when it ran: device, dtype, seconds, peak memory, output statistics.
    runtime: NotRequired[dict[str, Any]]
    # Per-range digests of the large files listed in `files` (their whole-file sha256 stays there).
    file_ranges: NotRequired[dict[str, FileRangesJson]]


# The records of a manifest. A merge builds one `Manifest` and serializes it once (`to_json`, at the
# write and for the Prefect artifacts); `to_json` fixes the key order of SPEC section 5, so the bytes
# written are those of the dict the code built by hand before.


@dataclass(frozen=True)
class TensorInfo:
    """One exported tensor: its shape and the torch dtype name it is stored in."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SourceModelConfig:
    """The exported model config's digest and where it came from, named without a local path."""

    sha256: str
    logical_path: str


@dataclass(frozen=True)
class ConfigTransform:
    """What changed in configs on the way: local-path keys removed, the tensor conversion, base files left out."""

    removed_keys: Mapping[str, list[str]]
    tensor_conversion: Mapping[str, Any] | None = None  # {"adapter": name, **its params}
    not_copied: Mapping[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"removed_keys": dict(self.removed_keys)}
        if self.tensor_conversion is not None:
            record["tensor_conversion"] = dict(self.tensor_conversion)
        if self.not_copied is not None:
            record["not_copied"] = dict(self.not_copied)
        return record


@dataclass(frozen=True)
class LoraFusion:
    """`lora_fusion`: the adapter fused into the exported weights, and with which settings."""

    adapter_name: str
    r: int
    lora_alpha: float
    scaling: float
    base_weights: str | None
    fused_modules: tuple[str, ...]
    excluded_adapters: tuple[str, ...]
    settings_source: str
    module_scaling: Mapping[str, float] | None = None  # modules whose scaling differs from `scaling`
    replaced_by_modules_to_save: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "adapter_name": self.adapter_name, "r": self.r, "lora_alpha": self.lora_alpha, "scaling": self.scaling,
            "base_weights": self.base_weights, "fused_modules": list(self.fused_modules),
            "excluded_adapters": list(self.excluded_adapters), "settings_source": self.settings_source,
        }
        if self.module_scaling is not None:
            record["module_scaling"] = dict(self.module_scaling)
        if self.replaced_by_modules_to_save is not None:
            record["replaced_by_modules_to_save"] = list(self.replaced_by_modules_to_save)
        return record


@dataclass(frozen=True)
class LoraAdapterRecord:
    """`lora_adapter`: the exported adapter directory's own manifest says what it holds."""

    adapter_name: str
    format: str
    base_model_name_or_path: str | None
    layout: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    excluded_adapters: tuple[str, ...]
    settings_source: str

    def to_json(self) -> LoraAdapterJson:
        return {"adapter_name": self.adapter_name, "format": self.format,
                "base_model_name_or_path": self.base_model_name_or_path, "layout": self.layout, "r": self.r,
                "lora_alpha": self.lora_alpha, "target_modules": list(self.target_modules),
                "excluded_adapters": list(self.excluded_adapters), "settings_source": self.settings_source}


@dataclass(frozen=True)
class UnchangedMeasurement:
    """`unchanged_check`: every exported tensor was compared with the base (mergeflow/export/check/unchanged.py)."""

    compared_tensors: int
    differing_tensors: int


@dataclass(frozen=True)
class Manifest:
    """merge_manifest.json (SPEC section 5) as a record; `to_json` is its one serialization."""

    artifact_type: ArtifactType
    architecture: str
    trained_components: tuple[str, ...]
    tensor_directory: str
    dtype: str
    max_shard_size_bytes: int
    source_files: Mapping[str, str]
    source_model_config: SourceModelConfig
    base_files: Mapping[str, str]
    files: Mapping[str, str]  # relative path -> sha256, sorted
    tensors: Mapping[str, TensorInfo]  # sorted by name
    config_transform: ConfigTransform
    producer: Mapping[str, str]
    verification: Mapping[str, str]
    checkpoint: CheckpointRecord  # the checkpoint source's own record (mergeflow.sources)
    lora_fusion: LoraFusion | None = None
    lora_adapter: LoraAdapterRecord | None = None
    unchanged_check: UnchangedMeasurement | None = None  # only when the guard compared every tensor
    # An original single-file layout: {layout, params, key_map: file key -> [[source, first row, end row, swapped]]}.
    original_layout: Mapping[str, Any] | None = None
    # Encoded weights: {method, kept_f32/excluded, tensors: key -> type, source sha256, errors...}.
    quantization: Mapping[str, Any] | None = None
    model_card: Mapping[str, Any] | None = None  # README.md's record (mergeflow/hub/model_card.py)
    runtime: Mapping[str, Any] | None = None  # the runtime check's measurement (mergeflow/ops/smoke.py)
    # Relative path -> the large file's per-range digests, of the same bytes as its `files` sha256.
    file_ranges: Mapping[str, FileRanges] | None = None
    schema_version: int = SCHEMA_VERSION
    backend: str = "fsdp"

    @property
    def source_fingerprint(self) -> str:
        smc = {"sha256": self.source_model_config.sha256, "logical_path": self.source_model_config.logical_path}
        return fingerprint([dict(self.source_files), smc])

    @property
    def base_fingerprint(self) -> str:
        return fingerprint(dict(self.base_files))

    def tensors_json(self) -> dict[str, TensorJson]:
        return {name: {"shape": list(info.shape), "dtype": info.dtype} for name, info in self.tensors.items()}

    def to_json(self) -> ManifestDocument:
        data: ManifestDocument = {
            "schema_version": self.schema_version,
            "artifact_type": self.artifact_type,
            "architecture": self.architecture,
            "backend": self.backend,
            "trained_components": list(self.trained_components),
            "tensor_directory": self.tensor_directory,
            "dtype": self.dtype,
            "max_shard_size_bytes": self.max_shard_size_bytes,
            "source_files": dict(self.source_files),
            "source_model_config": {"sha256": self.source_model_config.sha256,
                                    "logical_path": self.source_model_config.logical_path},
            "source_fingerprint": self.source_fingerprint,
            "base_files": dict(self.base_files),
            "base_fingerprint": self.base_fingerprint,
            "files": dict(self.files),
            "tensors": self.tensors_json(),
            "config_transform": self.config_transform.to_json(),
            "producer": dict(self.producer),
            "verification": dict(self.verification),
            "checkpoint": CheckpointRecord(**self.checkpoint),
        }
        if self.lora_fusion is not None:
            data["lora_fusion"] = self.lora_fusion.to_json()
        if self.lora_adapter is not None:
            data["lora_adapter"] = self.lora_adapter.to_json()
        if self.unchanged_check is not None:
            data[UNCHANGED_CHECK] = {"compared_tensors": self.unchanged_check.compared_tensors,
                                     "differing_tensors": self.unchanged_check.differing_tensors}
        if self.original_layout is not None:
            data["original_layout"] = dict(self.original_layout)
        if self.quantization is not None:
            data["quantization"] = dict(self.quantization)
        if self.model_card is not None:
            data["model_card"] = dict(self.model_card)
        if self.runtime is not None:
            data["runtime"] = dict(self.runtime)
        if self.file_ranges:
            data[FILE_RANGES] = {rel: {"size": r.size, "range_size": r.range_size, "sha256": list(r.sha256)}
                                 for rel, r in sorted(self.file_ranges.items())}
        return data


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _check_digest_map(name: str, value: Mapping[str, object]) -> None:
    for rel, digest in value.items():
        check_relative_name(rel, f"manifest {name}")
        if not _is_sha256(digest):
            raise ArtifactInvalidError(f"manifest {name}[{rel!r}] is not a sha256 hex digest")


def check_manifest(data: Any, artifact_types: Collection[str] | None = None) -> ManifestDocument:
    """Schema and types of a manifest; returns it unchanged when valid.

    `artifact_types`: the ones the registered outputs write (`test` passes them; the outputs live
    above this module, so it does not import them).
    """
    if not isinstance(data, dict):
        raise ArtifactInvalidError("merge_manifest.json is not a JSON object")
    for key, typ in _REQUIRED.items():
        if key not in data:
            raise ArtifactInvalidError(f"merge_manifest.json lacks {key!r}")
        value = data[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ArtifactInvalidError(f"merge_manifest.json: {key} has the wrong type ({type(value).__name__})")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ArtifactInvalidError(f"manifest schema_version {data['schema_version']} is not supported (expected {SCHEMA_VERSION})")
    if artifact_types is not None and data["artifact_type"] not in artifact_types:
        raise ArtifactInvalidError(f"manifest artifact_type {data['artifact_type']!r} is unknown")
    if data["backend"] != "fsdp":
        raise ArtifactInvalidError("manifest backend must be 'fsdp'")
    if data["max_shard_size_bytes"] <= 0:
        raise ArtifactInvalidError("manifest max_shard_size_bytes must be positive")
    if data["tensor_directory"] != ".":
        check_relative_name(data["tensor_directory"], "manifest tensor_directory")
    for name in ("source_files", "base_files", "files"):
        _check_digest_map(name, data[name])
    if not _is_sha256(data["source_fingerprint"]) or not _is_sha256(data["base_fingerprint"]):
        raise ArtifactInvalidError("manifest fingerprints must be sha256 hex digests")
    _check_source_model_config(data["source_model_config"])
    for key, info in data["tensors"].items():
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or info.get("dtype") not in DTYPES:
            raise ArtifactInvalidError(f"manifest tensors[{key!r}] must be {{shape: [...], dtype: <torch dtype name>}}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"]):
            raise ArtifactInvalidError(f"manifest tensors[{key!r}].shape must be non-negative integers")
    verification = data["verification"]
    for layer in VERIFICATION_LAYERS:
        if verification.get(layer) != "passed":
            raise ArtifactInvalidError(f"manifest verification.{layer} is not 'passed'")
    _check_unchanged_check(data.get(UNCHANGED_CHECK))
    quantization = data.get("quantization")
    if quantization is not None and not (isinstance(quantization, dict) and isinstance(quantization.get("method"), str)
                                         and isinstance(quantization.get("tensors"), dict)):
        raise ArtifactInvalidError("manifest quantization must be {method: ..., tensors: {...}}")
    _check_runtime(verification.get("runtime"), data.get("runtime"))
    card = data.get("model_card")
    if card is not None and not (isinstance(card, dict) and isinstance(card.get("file"), str) and card["file"] in data["files"]):
        raise ArtifactInvalidError("manifest model_card must name a file the manifest lists")
    if MANIFEST_NAME in data["files"]:
        raise ArtifactInvalidError("manifest files must not list the manifest itself")
    _check_file_ranges(data.get(FILE_RANGES), data["files"])
    _reject_absolute_paths(data)
    return data


def _check_runtime(status: Any, record: Any) -> None:
    """A published artifact's runtime check passed or did not run (a failed one is never published)."""
    if status not in ("passed", "not_run"):
        raise ArtifactInvalidError(f"manifest verification.runtime must be 'passed' or 'not_run', not {status!r}")
    if (status == "passed") != isinstance(record, dict):
        raise ArtifactInvalidError("manifest runtime: a passed runtime check has a record, and only then")


def _check_source_model_config(smc: Mapping[str, object]) -> None:
    path = smc.get("logical_path")
    from_base = isinstance(path, str) and path.startswith(BASE_CONFIG_PREFIX) and path.endswith("config.json")
    if not _is_sha256(smc.get("sha256")) or not (path in (VERL_CONFIG_PATH, FLAG_CONFIG_PATH) or from_base):
        raise ArtifactInvalidError(f"manifest source_model_config must hold sha256 and a logical_path "
                                   f"({VERL_CONFIG_PATH!r}, {FLAG_CONFIG_PATH!r} or '{BASE_CONFIG_PREFIX}...config.json')")
    if from_base:
        check_relative_name(path, "manifest source_model_config.logical_path")


def _check_file_ranges(value: Any, files: Mapping[str, str]) -> None:
    """`file_ranges`, when present: for files the manifest lists, digests that cover each file exactly."""
    if value is None:
        return
    if not isinstance(value, dict) or not value:
        raise ArtifactInvalidError(f"manifest {FILE_RANGES} must map listed files to their ranges (absent when there are none)")
    for rel, record in value.items():
        problem = _file_ranges_problem(record)
        if rel not in files:
            problem = "names a file the manifest does not list"
        if problem is not None:
            raise ArtifactInvalidError(f"manifest {FILE_RANGES}[{rel!r}] {problem}")


def _file_ranges_problem(record: Any) -> str | None:
    """What is wrong with one file's range record, None when it is right."""
    if not isinstance(record, dict) or set(record) != {"size", "range_size", "sha256"}:
        return "must be exactly {size, range_size, sha256}"
    size, range_size, digests = record["size"], record["range_size"], record["sha256"]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (size, range_size)):
        return "must give size and range_size as integers"
    if range_size <= 0 or range_size % RANGE_ALIGN:
        return f"has range_size {range_size}: it must be a positive multiple of {RANGE_ALIGN}"
    if size <= range_size:
        return f"has size {size}: only a file of more than one range ({range_size} bytes) has ranges"
    if not isinstance(digests, list) or len(digests) != range_count(size, range_size):
        count = len(digests) if isinstance(digests, list) else "no list of"
        return f"has {count} digests: {size} bytes in ranges of {range_size} need {range_count(size, range_size)}"
    if not all(_is_sha256(d) for d in digests):
        return "holds a digest that is not a sha256 hex digest"
    return None


def file_ranges_of(data: ManifestDocument) -> dict[str, FileRanges]:
    """The per-range digests of a checked manifest (none for a manifest written before they existed)."""
    return {rel: FileRanges(r["size"], r["range_size"], tuple(r["sha256"])) for rel, r in data.get(FILE_RANGES, {}).items()}


def _check_unchanged_check(value: Any) -> None:
    """The optional unchanged-weights measurement (mergeflow/export/check/unchanged.py), when present."""
    if value is None:
        return
    counts = value if isinstance(value, dict) and set(value) == {"compared_tensors", "differing_tensors"} else None
    if counts is None or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()) \
            or counts["differing_tensors"] > counts["compared_tensors"]:
        raise ArtifactInvalidError(f"manifest {UNCHANGED_CHECK} must be {{compared_tensors: n, differing_tensors: m <= n}}")


def _reject_absolute_paths(obj: Any, where: str = "manifest") -> None:
    """No local path of the producing machine may appear anywhere in the manifest."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _reject_absolute_paths(key, where)
            _reject_absolute_paths(value, f"{where}.{key}")
    elif isinstance(obj, list):
        for value in obj:
            _reject_absolute_paths(value, where)
    elif isinstance(obj, str) and (obj.startswith("/") or obj.startswith("~") or (len(obj) > 2 and obj[1:3] == ":\\")):
        raise ArtifactInvalidError(f"{where} holds an absolute path ({obj[:40]}...)")
