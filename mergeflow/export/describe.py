"""`mergeflow inspect`: what a checkpoint is, from its rank files' metadata (no tensor data)."""

from __future__ import annotations

from pathlib import Path

from mergeflow.architectures.schema import read_model_config
from mergeflow.errors import CheckpointError
from mergeflow.export.layout import plan_layouts
from mergeflow.formats import dcp
from mergeflow.formats.checkpoint_dir import format_of
from mergeflow.formats.rank_files import describe_state, load_rank_state
from mergeflow.formats.safetensors_format import nbytes
from mergeflow.formats.verl_checkpoint import (
    LORA_META,
    rank_file_names,
    read_fsdp_config,
)
from mergeflow.io.jsonfiles import JsonObject


def describe_checkpoint(actor_dir: Path, *, trust_checkpoint: bool = False) -> JsonObject:
    """What is this checkpoint? World size, layout, tensors, dtypes, LoRA adapters, class."""
    actor_dir = actor_dir.expanduser().resolve()
    if format_of(actor_dir) == "dcp":
        return _describe_dcp(actor_dir, trust_checkpoint)
    fsdp = read_fsdp_config(actor_dir)
    names = rank_file_names(actor_dir, fsdp.world_size)
    entries = [describe_state(load_rank_state(actor_dir / n, trust_checkpoint=trust_checkpoint), n) for n in names]
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
    adapters = sorted({part for key in layouts for part in _adapter_names(key)})
    config_path = actor_dir / "huggingface" / "config.json"
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
        "lora_adapters": adapters,
        "lora_meta": (actor_dir / LORA_META).is_file(),
        "class_name": class_name,
    }


def _describe_dcp(directory: Path, trust_checkpoint: bool) -> JsonObject:
    """The same summary for a torch Distributed Checkpoint, from its `.metadata` alone (safe unpickler)."""
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
        "lora_adapters": sorted({part for name in checkpoint.tensors for part in _adapter_names(name)}),
        "lora_meta": (directory / LORA_META).is_file(),
        "class_name": None,  # a DCP carries no model config: it comes from the base or --hf_model_config_path
    }


def _adapter_names(key: str) -> list[str]:
    parts = key.split(".")
    return [parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("lora_A", "lora_B") and i + 2 < len(parts)]
