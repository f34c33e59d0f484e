"""The small, typed records that tasks pass to each other (never tensors).

A `MergePlan` is composed of smaller frozen records, each about one thing: what the user asked
(`ExportOptions`), the training checkpoint (`CheckpointInputs`), the base model (`BaseInputs`),
the artifact to produce (`OutputTarget`), how tensors and configs change on the way
(`Conversion`) and, for LoRA checkpoints, the `LoraSpec`. `mergeflow.export.plan.build.build_plan`
is the one place that builds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Union

from mergeflow.config import Dtype
from mergeflow.formats.manifest import (  # noqa: F401 - Manifest: a record the tasks pass, for the flow too
    VERL_CONFIG_PATH,
    ArtifactType,
    Manifest,
)
from mergeflow.formats.rank_files import TensorEntry
from mergeflow.io.fs import FileStamp
from mergeflow.io.ranges import FileRanges
from mergeflow.lora.extract_spec import ExtractSpec
from mergeflow.lora.plan import LoraSpec

DtypePolicy = Dtype
BaseKind = Literal["pipeline", "transformer", "hub"]  # "hub": an adapter export whose base is only named


@dataclass(frozen=True)
class TensorLayout:
    """Where one global tensor's pieces live.

    chunk_ranks[c] lists the ranks that hold chunk c (the first is read, the others are
    replicas that must hold identical bytes). A replicated tensor has one chunk.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    shard_dim: int | None
    chunk_ranks: tuple[tuple[int, ...], ...]
    chunk_shapes: tuple[tuple[int, ...], ...]
    tied_to: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ExportOptions:
    """The user's choices that shape what is read and written."""

    dtype: DtypePolicy
    max_shard_size: int
    trust_checkpoint: bool = False
    workers: int = 2
    sign_key: str | None = None  # a PEM private key's absolute path: the artifact is signed before publication


@dataclass(frozen=True)
class CheckpointInputs:
    """The training checkpoint: where it is, its files, and the model config it is exported with.

    For a DCP, `rank_files` are the files the manifest hashes (`.metadata` and every `.distcp`), the
    world size counts the `.distcp` files, and the model config is not part of the checkpoint: it
    comes from --hf_model_config_path or the base (`config_logical_path` says which).
    """

    actor_dir: str
    config_dir: str
    world_size: int
    fsdp_version: int  # 0 for a DCP: it does not record which FSDP wrote it
    rank_files: tuple[str, ...]
    config_sha256: str  # the model config, recorded in the manifest
    format: str = "verl"  # the source kind: mergeflow.sources.registry.source_named(format)
    config_logical_path: str = VERL_CONFIG_PATH  # the manifest's source_model_config.logical_path


@dataclass(frozen=True)
class BaseInputs:
    """The base model: its directory, what it is, and every base file the artifact depends on."""

    base_dir: str  # "" when the base is only a Hub name (LoRA adapter export)
    kind: BaseKind
    component_dir: str  # the trained component's directory in the base ("" when not local)
    files: dict[str, str]  # base-relative path -> sha256
    copy_files: tuple[str, ...] = ()  # copied into the artifact (pipeline output)
    hub_id: str | None = None  # the base's Hub model id when known: the model card's base_model


@dataclass(frozen=True)
class OutputTarget:
    """The artifact: where it is staged and published, its type, and the tensors it must hold."""

    target: str
    staging: str
    lock: str
    artifact_type: ArtifactType
    architecture: str  # the _class_name at the artifact root
    transformer_class: str
    component: str
    tensor_directory: str  # "." or the trained component's folder
    weights_name: str
    expected_shapes: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]
    kind: str  # the output that writes it (mergeflow.outputs.registry): its writer, mapping and checks
    # The base component's weights, when the artifact names its own differently (an original single file).
    base_weights: str | None = None
    # The safetensors header metadata of every weight file, when the output plans its own (None: {"format": "pt"}).
    header_metadata: dict[str, str] | None = None

    @property
    def base_weights_name(self) -> str:
        """The weights name of the base's trained component (the artifact's unless it renames them)."""
        return self.base_weights or self.weights_name

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

    def relative(self, name: str) -> str:
        """Where a file of the tensor directory lies relative to the artifact root."""
        return name if self.tensor_directory == "." else f"{self.tensor_directory}/{name}"


@dataclass(frozen=True)
class Conversion:
    """How the base's configs and the trained tensors change on their way into the artifact."""

    adapter: str | None = None  # the architecture adapter that converts tensors (None: kept as trained)
    adapter_params: dict[str, str | int | float | bool] = field(default_factory=dict)  # recorded in the manifest
    output_shapes: dict[str, tuple[int, ...]] | None = None  # the exact tensor set when it is not the checkpoint's
    config_changes: dict[str, list[str]] = field(default_factory=dict)  # copied config -> local-path keys removed
    not_copied: dict[str, str] = field(default_factory=dict)  # base file -> why it stays out of the artifact


@dataclass(frozen=True)
class MergePlan:
    """Everything inspection decided, composed of the records above."""

    options: ExportOptions
    checkpoint: CheckpointInputs
    base: BaseInputs
    output: OutputTarget
    input_stamps: dict[str, FileStamp]
    fingerprint: str
    lora: LoraSpec | None = None
    conversion: Conversion = field(default_factory=Conversion)
    extract: ExtractSpec | None = None  # --extract-lora: the artifact is a LoRA of (checkpoint - base)


@dataclass(frozen=True)
class RankIndex:
    """One rank file, opened safely and described: metadata per key (its sha256 is hashed apart)."""

    rank: int
    file_name: str
    size: int
    entries: dict[str, TensorEntry]


@dataclass(frozen=True)
class CheckpointSource:
    """A tensor of the rank files, reassembled from its shards."""

    layout: TensorLayout
    kind: Literal["checkpoint"] = "checkpoint"


@dataclass(frozen=True)
class BaseModelSource:
    """A tensor of the base model's safetensors files (LoRA-only fusion takes its frozen weights there)."""

    file: str
    key: str
    kind: Literal["base_model"] = "base_model"


@dataclass(frozen=True)
class ComputedSource:
    """Another write's result: a conversion can take an already fused LoRA weight."""

    write: TensorWrite
    kind: Literal["computed"] = "computed"


TensorSource = Union[CheckpointSource, BaseModelSource, ComputedSource]


@dataclass(frozen=True)
class LoraFuse:
    """Fold one LoRA adapter into the frozen weight (or bias) of one module, as PEFT merges it."""

    param: Literal["weight", "bias"]
    module: str
    scaling: float
    rank: int
    base: TensorSource | None = None  # the frozen tensor, set once its source is known
    lora_A: TensorSource | None = None
    lora_B: TensorSource | None = None
    lora_magnitude_vector: TensorSource | None = None
    lora_B_bias: TensorSource | None = None
    op: Literal["lora_fuse"] = "lora_fuse"


@dataclass(frozen=True)
class BaseCopy:
    """A frozen weight copied from its source unchanged (LoRA-only fusion: from the base model)."""

    base: TensorSource
    op: Literal["base_copy"] = "base_copy"


@dataclass(frozen=True)
class ArchitectureOp:
    """A tensor conversion of an architecture adapter: whole source tensors in, one tensor out."""

    op: str  # one of the adapter's `ops`
    inputs: tuple[TensorSource, ...]
    params: dict[str, int | float | str | None] = field(default_factory=dict)


Transform = Union[LoraFuse, BaseCopy, ArchitectureOp]


@dataclass(frozen=True)
class TensorWrite:
    """One output tensor: its name in the artifact, where its pieces come from, its dtype."""

    name: str
    source_key: str
    layout: TensorLayout
    out_dtype: str
    transform: Transform | None = None  # LoRA fusion or architecture conversion, if any


@dataclass(frozen=True)
class ShardPlan:
    index: int
    file_name: str
    tensors: tuple[TensorWrite, ...]
    nbytes: int
    fingerprint: str
    metadata: dict[str, str] | None = None  # safetensors header metadata; None means {"format": "pt"}
    # Whether the file holds enough of the artifact's bytes for per-range digests (mergeflow.io.ranges.large_share,
    # planned with the whole artifact in view); the writer still takes none for a file of one range.
    ranges: bool = True


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
    # "0x" + sha256 of the data section, for a file whose header carries it (modelspec.hash_sha256).
    data_sha256: str | None = None
    # A large file's per-range digests, taken from the same bytes as `sha256` (manifest `file_ranges`).
    ranges: FileRanges | None = None

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
    ranges: FileRanges | None = None  # a large copied file's per-range digests (manifest `file_ranges`)


@dataclass(frozen=True)
class CopyResult:
    """The copied base files, and the local-path keys removed from copied configs."""

    files: tuple[FileRecord, ...]
    removed_keys: dict[str, list[str]]
    reused: tuple[str, ...] = ()  # files an earlier attempt had copied right, kept as they were (a resume)


@dataclass(frozen=True)
class ValidationReport:
    artifact_dir: str
    manifest_sha256: str
    architecture: str
    files_checked: int
    tensors_checked: int
    layers: dict[str, str]


@dataclass(frozen=True)
class SealRecord:
    """What the seal step added beside the validated manifest (mergeflow/formats/seal.py): its pin, and a
    signature when a key is configured (`signed_by`: the key's fingerprint)."""

    manifest_sha256: str
    signed_by: str | None = None

    @property
    def files_added(self) -> int:
        return 1 if self.signed_by is None else 2


@dataclass(frozen=True)
class SmokeSettings:
    """How a merge's --smoke runs the check: device, dtype, and whether the base's remote code may load."""

    device: str = "cpu"
    dtype: str = "float32"
    trust_remote_code: bool = False
