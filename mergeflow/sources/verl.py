"""verl's per-rank files: `fsdp_config.json` + one `model_world_size_W_rank_R.pt` per rank (+ `huggingface/`).

Each rank file is one `torch.save` zip holding that rank's DTensor shards; the byte-level readers are
mergeflow/formats/{verl_checkpoint,rank_files,rank_pickle,zip_records}.py. The model config is the
checkpoint's own `huggingface/config.json` (or --hf_model_config_path's), and LoRA runs carry
`lora_train_meta.json`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import CheckpointError
from mergeflow.formats.manifest import VERL_CONFIG_PATH
from mergeflow.formats.verl_checkpoint import (
    FSDP_CONFIG,
    LORA_META,
    rank_file_names,
    read_fsdp_config,
)
from mergeflow.formats.zip_records import sha256_and_check_records
from mergeflow.sources.base import (
    CheckpointDescription,
    CheckpointSource,
    Indexing,
    ModelConfigSource,
    OpenedCheckpoint,
    lora_adapter_names,
)

if TYPE_CHECKING:
    from mergeflow.config import ModelMergerConfig
    from mergeflow.formats.manifest import CheckpointRecord
    from mergeflow.records import CheckpointInputs, RankIndex
    from mergeflow.sources.verl_ranks import RankStates


class VerlSource(CheckpointSource):
    kind = "verl"
    indexing = Indexing.PER_FILE
    marker_files = (FSDP_CONFIG,)
    requires_lora_meta = True

    def detect(self, directory: Path) -> bool:
        return (directory / FSDP_CONFIG).exists()

    def listed_files(self, directory: Path) -> list[Path]:
        fsdp = read_fsdp_config(directory)
        return [directory / name for name in rank_file_names(directory, fsdp.world_size)]

    def file_hasher(self, trust_checkpoint: bool = False) -> Callable[[Path], str]:
        return sha256_and_check_records  # one zip per rank file: every record's CRC-32 checked while hashing

    def preflight(self, config: ModelMergerConfig, directory: Path) -> list[Path]:
        from mergeflow.export.plan import (
            input_checks as checks,  # imported here: they are not needed to plan
        )

        rank_files = self.listed_files(directory)
        has_meta = (directory / LORA_META).is_file()
        checks.check_lora_flags(config, has_meta)
        if has_meta and not config.fuse_lora:
            checks.preflight_maybe_adapter(config, directory)
        else:
            checks.preflight_with_base(config)
        return rank_files

    def describe(self, directory: Path, *, trust_checkpoint: bool = False) -> CheckpointDescription:
        from mergeflow.architectures.schema import read_model_config
        from mergeflow.export.reconstruct.layout import plan_layouts
        from mergeflow.formats.rank_files import describe_state, load_rank_state
        from mergeflow.formats.safetensors_format import nbytes

        fsdp = read_fsdp_config(directory)
        names = rank_file_names(directory, fsdp.world_size)
        entries = [describe_state(load_rank_state(directory / n, trust_checkpoint=trust_checkpoint), n) for n in names]
        layouts = plan_layouts(entries)
        placements = {e.placements for e in entries[0].values()}
        if all(not p for p in placements):
            kind = "plain"
        elif any(len(p) == 2 for p in placements):
            kind = "HSDP"
        else:
            kind = f"FSDP{fsdp.version}"
        dtypes: dict[str, int] = {}
        for layout in layouts.values():
            dtypes[layout.dtype] = dtypes.get(layout.dtype, 0) + 1
        config_path = directory / "huggingface" / "config.json"
        class_name = None
        if config_path.is_file():
            class_name = read_model_config(config_path, CheckpointError, "huggingface/config.json").get("_class_name")
        return {
            "world_size": fsdp.world_size,
            "fsdp_version": fsdp.version,
            "layout": kind,
            "tensors": len(layouts),
            "bytes": sum(nbytes(l.dtype, l.shape) for l in layouts.values()),
            "dtypes": dtypes,
            "lora_adapters": lora_adapter_names(layouts),
            "lora_meta": (directory / LORA_META).is_file(),
            "class_name": class_name,
        }

    def open(self, directory: Path, *, trust_checkpoint: bool = False) -> OpenedCheckpoint:
        fsdp = read_fsdp_config(directory)
        names = tuple(rank_file_names(directory, fsdp.world_size))
        # mmap: unpickling the key list costs no private memory; every rank's keys are compared later.
        # Through the shared cache, so load-rank-00000 reuses the parsed file.
        from mergeflow.sources.verl_ranks import (
            RankStates,  # torch: never on the pre-flight's path
        )

        keys = tuple(RankStates(directory, names[:1], trust_checkpoint=trust_checkpoint).state(0))
        return OpenedCheckpoint(self, directory, names, fsdp.world_size, fsdp.version, keys, self.marker_files)

    def model_config_source(self, config: ModelMergerConfig, config_dir: Path, base: Path | None) -> ModelConfigSource:
        # config_dir: --hf_model_config_path, else the checkpoint's huggingface/ (mergeflow.export.plan.input_checks.resolve_inputs)
        return ModelConfigSource(config_dir / "config.json", VERL_CONFIG_PATH,
                                 "huggingface/config.json of the checkpoint", CheckpointError)

    def checkpoint_record(self, checkpoint: CheckpointInputs) -> CheckpointRecord:
        return {"world_size": checkpoint.world_size, "fsdp_version": checkpoint.fsdp_version}

    def label(self, checkpoint: CheckpointInputs) -> str:
        return f"FSDP v{checkpoint.fsdp_version}"

    def index_units(self, checkpoint: CheckpointInputs) -> int:
        return checkpoint.world_size

    def index_file(self, checkpoint: CheckpointInputs, unit: int, *, trust_checkpoint: bool = False) -> RankIndex:
        from mergeflow.sources.verl_ranks import index_rank_file

        return index_rank_file(Path(checkpoint.actor_dir), checkpoint.rank_files[unit], unit, trust_checkpoint=trust_checkpoint)

    def indexed_note(self, checkpoint: CheckpointInputs, indexed: int) -> str:
        return f"Indexed {indexed} rank files of world size {checkpoint.world_size}"

    def open_pieces(self, checkpoint: CheckpointInputs, *, trust_checkpoint: bool = False) -> RankStates:
        from mergeflow.sources.verl_ranks import RankStates

        return RankStates(Path(checkpoint.actor_dir), checkpoint.rank_files, trust_checkpoint=trust_checkpoint)
