"""A torch Distributed Checkpoint (`.metadata` + `*.distcp`, as accelerate, VeOmni and torchtitan save it).

The format (mergeflow/formats/dcp.py, dcp_layout.py) says where each chunk's bytes are; this module turns
its chunks into `TensorLayout`s (chunk c plays rank c) and assembles them through the same reconstruct
path as verl's rank files, so there is one way to rebuild and round-trip verify a tensor. A DCP carries
no model config (--hf_model_config_path's, else the base transformer's) and does not record which FSDP
wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.architectures.registry import base_layout
from mergeflow.errors import (
    BaseModelError,
    CheckpointError,
    SchemaMismatchError,
    UsageError,
)
from mergeflow.formats.dcp_layout import (
    METADATA,
    NO_MODEL_CONFIG,
    dcp_files,
    is_dcp_dir,
)
from mergeflow.formats.manifest import BASE_CONFIG_PREFIX, FLAG_CONFIG_PATH
from mergeflow.formats.verl_checkpoint import LORA_META
from mergeflow.io.fs import FileStamp
from mergeflow.io.stamped_cache import StampedCache
from mergeflow.sources.base import (
    CheckpointDescription,
    CheckpointSource,
    Indexing,
    ModelConfigSource,
    OpenedCheckpoint,
    lora_adapter_names,
)

if TYPE_CHECKING:
    import torch

    from mergeflow.config import ModelMergerConfig
    from mergeflow.formats.dcp import DcpCheckpoint, DcpChunks, DcpTensor
    from mergeflow.formats.manifest import CheckpointRecord
    from mergeflow.records import CheckpointInputs, TensorLayout

# torch (formats.dcp, the records, reconstruct) is imported inside the functions below: the command
# line's pre-flight detects a DCP through this module before torch loads.


def tensor_layout(tensor: DcpTensor) -> TensorLayout:
    """The chunks of one DCP tensor as a TensorLayout: chunk c is "rank" c, with no replicas."""
    from mergeflow.records import TensorLayout

    return TensorLayout(tensor.key, tensor.dtype, tensor.shape, tensor.shard_dim,
                        tuple((c,) for c in range(len(tensor.chunks))), tensor.chunk_shapes)


def dcp_layouts(checkpoint: DcpCheckpoint) -> dict[str, TensorLayout]:
    """Every tensor's layout by its Diffusers name (what verl's `rank_layouts` gives per raw key)."""
    return {name: tensor_layout(tensor) for name, tensor in sorted(checkpoint.tensors.items())}


class DcpSources:
    """Parsed DCP checkpoints shared by the tasks of one export (its session), keyed by the `.metadata` stamp:
    `.metadata` is parsed once per export (formats.dcp.parsed_dcp, shared with the hash pass that
    CRC-checks the `.distcp` records) instead of once per shard task."""

    @classmethod
    def chunks(cls, directory: Path, *, trust_checkpoint: bool = False) -> DcpChunks:
        from mergeflow.formats.dcp import DcpChunks, parsed_dcp
        from mergeflow.io.session import current_session

        stamp = FileStamp.of(directory / METADATA)
        cache: StampedCache[DcpChunks] = current_session().cache("dcp-chunks", capacity=8)
        return cache.get_or_load((str(directory), stamp, trust_checkpoint),
                                 lambda: DcpChunks(parsed_dcp(directory, trust_checkpoint=trust_checkpoint)))


def check_keys(checkpoint: DcpCheckpoint, expected: dict[str, tuple[int, ...]]) -> None:
    """The DCP must hold exactly the base's tensors (after wrapper stripping), with the same shapes."""
    from mergeflow.export.reconstruct.rebuild import check_coverage

    actual = {name: t.shape for name, t in checkpoint.tensors.items()}
    if not set(actual) & set(expected):
        raise SchemaMismatchError(
            f"none of the {len(actual)} DCP keys names a tensor of the base (e.g. {', '.join(sorted(actual)[:2])} vs "
            f"{', '.join(sorted(expected)[:2])}); is this the right base, or a DCP of another model?")
    check_coverage(expected, actual)


def read_tensor(chunks: DcpChunks, name: str) -> torch.Tensor:
    """One global tensor, assembled by reconstruct's path and round-trip verified chunk by chunk."""
    import torch

    from mergeflow.export.reconstruct.rebuild import (
        global_pieces,
        verified_chunks,
        verify_round_trip,
    )

    layout = tensor_layout(chunks.checkpoint.tensors[name])
    pieces = verified_chunks(layout, chunks)
    parts = list(global_pieces(layout, pieces, layout.dtype, name))
    written = parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]).view(layout.shape)
    verify_round_trip(layout, written, pieces, layout.dtype, name)
    return written


class DcpSource(CheckpointSource):
    kind = "dcp"
    indexing = Indexing.METADATA

    def detect(self, directory: Path) -> bool:
        return is_dcp_dir(directory)  # a finished save: `.metadata` beside its `.distcp` files

    def listed_files(self, directory: Path) -> list[Path]:
        return [directory / name for name in dcp_files(directory)]

    def file_hasher(self, trust_checkpoint: bool = False) -> Callable[[Path], str]:
        # A `.distcp` is many `torch.save` zips back to back, found from `.metadata` (parsed as the export
        # parses it, hence the trust flag). Imported here (torch), in the caller's thread: never first from
        # the background hashing thread.
        from mergeflow.formats import dcp

        return dcp.sha256_and_check_distcp_trusted if trust_checkpoint else dcp.sha256_and_check_distcp

    def preflight(self, config: ModelMergerConfig, directory: Path) -> list[Path]:
        # Whether it holds LoRA is in `.metadata` (a pickle the flow reads): only what every branch checks.
        from mergeflow.export.plan import (
            input_checks as checks,  # imported here: they are not needed to plan
        )

        checks.preflight_dcp(config, directory)
        return self.listed_files(directory)

    def describe(self, directory: Path, *, trust_checkpoint: bool = False) -> CheckpointDescription:
        """From `.metadata` alone (safe unpickler)."""
        from mergeflow.formats import dcp
        from mergeflow.formats.safetensors_format import nbytes

        checkpoint = dcp.open_dcp(directory, trust_checkpoint=trust_checkpoint)
        layouts = list(checkpoint.tensors.values())
        dtypes: dict[str, int] = {}
        for layout in layouts:
            dtypes[layout.dtype] = dtypes.get(layout.dtype, 0) + 1
        return {
            "world_size": len(checkpoint.files) - 1,  # one .distcp per writing rank
            "fsdp_version": None,  # DCP does not record it
            "layout": "DCP",
            "tensors": len(layouts),
            "bytes": sum(nbytes(l.dtype, l.shape) for l in layouts),
            "dtypes": dtypes,
            "lora_adapters": lora_adapter_names(checkpoint.tensors),
            "lora_meta": (directory / LORA_META).is_file(),
            "class_name": None,  # a DCP carries no model config: it comes from the base or --hf_model_config_path
        }

    def open(self, directory: Path, *, trust_checkpoint: bool = False) -> OpenedCheckpoint:
        parsed = DcpSources.chunks(directory, trust_checkpoint=trust_checkpoint).checkpoint
        return OpenedCheckpoint(self, directory, parsed.files, len(parsed.files) - 1, 0, tuple(parsed.tensors),
                                self.marker_files)

    def model_config_source(self, config: ModelMergerConfig, config_dir: Path, base: Path | None) -> ModelConfigSource:
        """--hf_model_config_path's, else the base transformer's."""
        if config.model_config_given():
            return ModelConfigSource(config_dir / "config.json", FLAG_CONFIG_PATH,
                                     "config.json of --hf_model_config_path", CheckpointError)
        if base is None:
            raise UsageError(NO_MODEL_CONFIG)
        path = base_layout(base, config.component).transformer_dir / "config.json"
        relative = path.relative_to(base).as_posix()
        return ModelConfigSource(path, BASE_CONFIG_PREFIX + relative, f"{relative} of the base", BaseModelError)

    def checkpoint_record(self, checkpoint: CheckpointInputs) -> CheckpointRecord:
        return {"layout": "dcp", "world_size": checkpoint.world_size}  # a DCP does not record which FSDP wrote it

    def label(self, checkpoint: CheckpointInputs) -> str:
        return "torch DCP"

    def read_layouts(self, checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> dict[str, TensorLayout]:
        """Read `.metadata` safely: every tensor's chunks, checked to tile it and to lie inside their files."""
        return dcp_layouts(DcpSources.chunks(Path(checkpoint.actor_dir), trust_checkpoint=trust_checkpoint).checkpoint)

    def indexed_note(self, checkpoint: CheckpointInputs, indexed: int) -> str:
        return f"Indexed {indexed} tensors in the DCP's {checkpoint.world_size} .distcp files"

    def open_pieces(self, checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> DcpChunks:
        return DcpSources.chunks(Path(checkpoint.actor_dir), trust_checkpoint=trust_checkpoint)
