"""The small, JSON-friendly records that tasks pass to each other (never tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mergeflow.fsops import FileStamp
from mergeflow.layout import TensorLayout
from mergeflow.rank_files import TensorEntry


@dataclass(frozen=True)
class MergePlan:
    """Everything `inspect` decided: resolved paths, the checkpoint shape, the base schema."""

    config: dict[str, Any]
    actor_dir: str
    config_dir: str
    base_dir: str
    target: str
    staging: str
    lock: str
    world_size: int
    fsdp_version: int
    rank_files: tuple[str, ...]
    base_kind: str
    architecture: str  # the _class_name at the artifact root
    transformer_class: str
    component: str
    base_component_dir: str
    tensor_directory: str
    artifact_type: str
    weights_name: str
    expected_shapes: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]
    input_stamps: dict[str, FileStamp]
    source_config_sha256: str
    base_files: dict[str, str]
    fingerprint: str
    lora: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    copy_files: tuple[str, ...] = ()  # base files copied into the artifact (pipeline output)

    @property
    def artifact_dir(self) -> str:
        return f"{self.staging}/artifact"

    @property
    def tensor_dir(self) -> str:
        """Where the weight shards go inside the staged artifact."""
        if self.tensor_directory == ".":
            return self.artifact_dir
        return f"{self.artifact_dir}/{self.tensor_directory}"

    @property
    def work_dir(self) -> str:
        return f"{self.staging}/work"


@dataclass(frozen=True)
class RankIndex:
    """One rank file, opened safely and described: metadata per key (its sha256 is hashed apart)."""

    rank: int
    file_name: str
    size: int
    entries: dict[str, TensorEntry]


@dataclass(frozen=True)
class TensorWrite:
    """One output tensor: its name in the artifact, where its pieces come from, its dtype."""

    name: str
    source_key: str
    layout: TensorLayout
    out_dtype: str
    transform: dict[str, Any] | None = None  # LoRA fusion or architecture conversion, if any


@dataclass(frozen=True)
class ShardPlan:
    index: int
    file_name: str
    tensors: tuple[TensorWrite, ...]
    nbytes: int
    fingerprint: str
    metadata: dict[str, str] | None = None  # safetensors header metadata; None means {"format": "pt"}


@dataclass(frozen=True)
class OutputPlan:
    shards: tuple[ShardPlan, ...]
    total_size: int
    tensor_count: int
    indexed: bool  # True when an index.json names several shards


@dataclass(frozen=True)
class ShardRecord:
    """A written, round-trip-verified shard in the staging directory."""

    file_name: str
    sha256: str
    size: int
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    plan_fingerprint: str
    # The file's stamp right after its bytes were proven equal to the hashed stream.
    verified_stamp: FileStamp

    def verified(self) -> "VerifiedFile":
        return VerifiedFile(self.sha256, self.verified_stamp)


@dataclass(frozen=True)
class VerifiedFile:
    """A staged file whose sha256 is proven to be that of its bytes, and its stamp at that moment.

    Validation before publish takes the digest as read while the stamp (size, mtime, ctime,
    inode) is unchanged, instead of reading a just-verified gigabyte a second time.
    """

    sha256: str
    stamp: FileStamp


@dataclass(frozen=True)
class FileRecord:
    """A non-tensor file of the artifact (config, index, copied component file)."""

    rel_path: str
    sha256: str
    size: int
    origin: str  # "written" | "copied"


@dataclass(frozen=True)
class CopyResult:
    """The copied base files, and the local-path keys removed from copied configs."""

    files: tuple[FileRecord, ...]
    removed_keys: dict[str, list[str]]


@dataclass(frozen=True)
class ValidationReport:
    artifact_dir: str
    manifest_sha256: str
    architecture: str
    files_checked: int
    tensors_checked: int
    layers: dict[str, str]
