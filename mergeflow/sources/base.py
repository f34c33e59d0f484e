"""What every kind of training checkpoint answers: the one protocol the rest of mergeflow reads a checkpoint through.

A source (verl's per-rank files, a torch DCP, ...) is one module in this package and one row in
`mergeflow.sources.registry`. Nothing outside this package branches on which kind a directory holds:
planning, the pre-flight, `inspect`, the flow, the manifest and the UI ask the source.

Imported by the command line's pre-flight before torch loads: this module, the registry and each
source's module import torch (and the records, which import it) only inside the methods that read tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypedDict

from mergeflow.errors import BaseModelError, CheckpointError

if TYPE_CHECKING:
    import torch

    from mergeflow.config import ModelMergerConfig
    from mergeflow.formats.manifest import CheckpointRecord
    from mergeflow.records import CheckpointInputs, RankIndex, TensorLayout


class PieceSource(Protocol):
    """Where a layout's pieces are read: `local(r, key)` is piece r of `key` (chunk_ranks name r).

    verl's rank files (RankStates: r is a rank) and a torch DCP (DcpChunks: r is a chunk) both
    answer it, so reconstruction and round-trip verification are one path for both.
    """

    def local(self, rank: int, key: str) -> torch.Tensor: ...

    def local_in_place(self, rank: int, key: str) -> torch.Tensor:
        """Piece r of `key` for byte-level use only: written, hashed, compared with memcmp, scanned by numpy.

        It may view memory torch's kernels must not read as its dtype (a DCP chunk at an odd file offset,
        which `local` copies into an aligned tensor): a streamed tensor's pieces are only ever bytes, so
        they are read in place, and private memory does not grow with the largest tensor.
        """
        ...


class Indexing(Enum):
    """How the merge flow finds every tensor's layout (its task runs, their names and caching, follow from it)."""

    # One cached task per file (`load-rank-NNNNN`, keyed by the file's stamp): `index_file` gives each
    # file's RankIndex, and `combine-rank-layouts` checks the ranks agree and combines them.
    PER_FILE = "per_file"
    # The checkpoint's own metadata lists every layout: one task (`index-dcp-metadata`) runs `read_layouts`.
    METADATA = "metadata"


class CheckpointDescription(TypedDict):
    """`mergeflow inspect`'s JSON line: what a checkpoint is, from its metadata alone (key order as printed)."""

    world_size: int
    fsdp_version: int | None  # None: the kind does not record it (a DCP)
    layout: str  # "plain", "FSDP1", "FSDP2", "HSDP", "DCP"
    tensors: int
    bytes: int
    dtypes: dict[str, int]  # dtype -> tensors stored in it
    lora_adapters: list[str]
    lora_meta: bool  # lora_train_meta.json is present
    class_name: str | None  # the checkpoint's own config's _class_name, when it has one


@dataclass(frozen=True)
class OpenedCheckpoint:
    """What planning needs of a checkpoint: its files, shape and keys, read from metadata only."""

    source: CheckpointSource
    directory: Path
    files: tuple[str, ...]  # hashed into source_files: rank files, or .metadata and every .distcp
    world_size: int
    fsdp_version: int  # 0: the kind does not record it (a DCP)
    keys: tuple[str, ...]  # tensor names as the LoRA rules read them (a DCP's with wrapper prefixes removed)
    marker_files: tuple[str, ...]  # small files stamped beside the hashed ones (fsdp_config.json)

    @property
    def format(self) -> str:
        """The source's kind, as `CheckpointInputs.format` records it."""
        return self.source.kind


@dataclass(frozen=True)
class ModelConfigSource:
    """The model config an export is planned with, and how the manifest names it."""

    path: Path
    logical_path: str  # source_model_config.logical_path: no local path
    what: str  # how messages name it
    error: type[CheckpointError] | type[BaseModelError]


class CheckpointSource(ABC):
    """One kind of training checkpoint. Stateless: the registry holds one instance per kind."""

    kind: ClassVar[str]  # its name: CheckpointInputs.format, `source_named(kind)`
    indexing: ClassVar[Indexing]
    # Small files beside the hashed ones whose digests the manifest's source_files also records.
    marker_files: ClassVar[tuple[str, ...]] = ()
    # LoRA: True when only lora_train_meta.json can give r and lora_alpha (verl writes it beside every
    # LoRA run); False when a PEFT adapter_config.json (--adapter-config, or beside the checkpoint) may.
    requires_lora_meta: ClassVar[bool] = False

    # --- the directory: detection, files, the pre-flight -------------------------------------------------

    @abstractmethod
    def detect(self, directory: Path) -> bool:
        """True when `directory` holds this kind, from its listing alone (no file opened)."""

    @abstractmethod
    def listed_files(self, directory: Path) -> list[Path]:
        """The files the manifest will hash (the pre-flight's prefetch), from the listing and small files only."""

    @abstractmethod
    def file_hasher(self, trust_checkpoint: bool = False) -> Callable[[Path], str]:
        """How one of its files is hashed for the manifest, every record checked in the same pass."""

    @abstractmethod
    def preflight(self, config: ModelMergerConfig, directory: Path) -> list[Path]:
        """The command line's refusals before Prefect or torch load (mergeflow.export.plan.preflight); returns `listed_files`."""

    # --- metadata only: inspect and planning -------------------------------------------------------------

    @abstractmethod
    def describe(self, directory: Path, *, trust_checkpoint: bool = False) -> CheckpointDescription:
        """`mergeflow inspect`: world size, layout, tensors, dtypes, LoRA adapters, class (no tensor data)."""

    @abstractmethod
    def open(self, directory: Path, *, trust_checkpoint: bool = False) -> OpenedCheckpoint:
        """Its metadata (files, world size, keys for LoRA detection), refusing what is not one."""

    @abstractmethod
    def model_config_source(self, config: ModelMergerConfig, config_dir: Path, base: Path | None) -> ModelConfigSource:
        """Where the model config comes from: the checkpoint's own, --hf_model_config_path's, or the base's."""

    # --- the manifest and the UI --------------------------------------------------------------------------

    @abstractmethod
    def checkpoint_record(self, checkpoint: CheckpointInputs) -> CheckpointRecord:
        """The manifest's `checkpoint` object (its field order is part of the manifest's bytes)."""

    @abstractmethod
    def label(self, checkpoint: CheckpointInputs) -> str:
        """How the export summary names its layout, after the world size (e.g. "FSDP v2")."""

    def marker_digests(self, directory: Path) -> dict[str, str]:
        """sha256 of each marker file, for the manifest's source_files (after the hashed files)."""
        from mergeflow.io.session import sha256_file

        return {name: sha256_file(directory / name) for name in self.marker_files}

    # --- tensors: layouts and the piece reader ------------------------------------------------------------

    def index_units(self, checkpoint: CheckpointInputs) -> int:
        """Indexing.PER_FILE: how many files are indexed, one task each (`index_file(checkpoint, 0..n-1)`)."""
        raise NotImplementedError(f"a {self.kind} checkpoint is indexed by {self.indexing.value}, not per file")

    def index_file(self, checkpoint: CheckpointInputs, unit: int, *, trust_checkpoint: bool = False) -> RankIndex:
        """Indexing.PER_FILE: one file's tensors (metadata only), combined across files by combine-rank-layouts."""
        raise NotImplementedError(f"a {self.kind} checkpoint is indexed by {self.indexing.value}, not per file")

    def read_layouts(self, checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> dict[str, TensorLayout]:
        """Indexing.METADATA: every tensor's layout, from the checkpoint's own metadata."""
        raise NotImplementedError(f"a {self.kind} checkpoint is indexed {self.indexing.value}, not from its metadata")

    @abstractmethod
    def indexed_note(self, checkpoint: CheckpointInputs, indexed: int) -> str:
        """The flow's log line once indexed (`indexed`: files per file, else tensors)."""

    @abstractmethod
    def open_pieces(self, checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> PieceSource:
        """The reader of a planned checkpoint's pieces (shared within the export: mergeflow.io.session)."""


def lora_adapter_names(keys: Iterable[str]) -> list[str]:
    """The adapter names in LoRA keys (`...lora_A.<name>.weight`), sorted: what `inspect` lists."""
    names: set[str] = set()
    for key in keys:
        parts = key.split(".")
        names.update(parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("lora_A", "lora_B") and i + 2 < len(parts))
    return sorted(names)
