"""A full-size FLUX.1-dev FSDP2 checkpoint written tensor by tensor: real scale without the RAM.

`generate(root)` writes what a verl run of FLUX.1-dev on 8 ranks saves, plus its base:

    ROOT/actor/model_world_size_8_rank_{0..7}.pt    ~3 GB each, 23.8 GB in all (bf16)
    ROOT/actor/fsdp_config.json                      {"FSDP_version": 2, "world_size": 8}
    ROOT/actor/huggingface/config.json               FluxTransformer2DModel config (save_config)
    ROOT/base/config.json + diffusion_pytorch_model-0000i-of-00003.safetensors + index
    ROOT/generated.json                              what was generated; written last = complete

Rank files are what `torch.save(model.state_dict())` writes after `fully_shard`, byte for
byte, streamed one local shard at a time with values from a seeded pool (fsdp_stream.py).

The base's weights are sparse: each safetensors file is its exact header followed by a hole
of the right size (`ftruncate`), because a full-weight export reads only the base's
headers. Headers (names, dtypes, shapes, offsets, padding) and the greedy sharding are
diffusers' `save_pretrained` defaults.

    python bench/flux_full_scale.py /tmp/flux-full            # full size, W=8 (~24 GB)
    python bench/flux_full_scale.py /tmp/flux-tiny --tiny -w 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# A sibling module: found when this file runs as a script, and by importers that put bench/ on sys.path.
from fsdp_stream import (
    POOL_ELEMENTS,
    RankSlice,
    TensorSpec,
    WeightSource,
    rank_slice,
    write_rank_files,
)
from measure import status_kb

__all__ = ["FLUX_DEV_CONFIG", "Generated", "RankSlice", "TensorSpec", "WeightSource", "generate",
           "load_complete", "rank_slice", "remove", "safetensors_header", "write_base"]

# The diffusers FLUX.1-dev transformer: black-forest-labs/FLUX.1-dev transformer/config.json.
FLUX_DEV_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
CLASS_NAME = "FluxTransformer2DModel"
MANIFEST = "generated.json"
# diffusers' ModelMixin.save_pretrained default.
BASE_MAX_SHARD_SIZE = "10GB"

# safetensors (0.4 .. 0.8) sorts tensors by dtype, in the reverse of the order of its Dtype
# enum, then by name; only the relative order matters here.
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_SAFETENSORS_ORDER = {dtype: i for i, dtype in enumerate(_SAFETENSORS_DTYPES)}


@dataclass(frozen=True)
class Generated:
    """Where a generated checkpoint lies and what it holds."""

    root: Path
    actor_dir: Path
    base_dir: Path
    rank_files: tuple[Path, ...]
    world_size: int
    rank_bytes: int  # apparent size of the rank files together
    base_bytes: int  # apparent size of the base weights (mostly holes)
    tensor_bytes: int  # the model's parameters, as they will be exported
    seconds: float


def meta_model(class_name: str, config: Mapping[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The Diffusers model on the meta device: names, shapes and dtypes without any weights."""
    import diffusers

    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        model = cls(**copy.deepcopy(dict(config)))
    return model.to(dtype)


def tensor_specs(model: torch.nn.Module) -> tuple[OrderedDict[str, Any], list[TensorSpec]]:
    """The model's state_dict (kept for its `_metadata`, which torch.save pickles) and its specs."""
    state = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    specs: list[TensorSpec] = []
    for name, value in state.items():
        if name in buffers:
            # FLUX has none; a buffer would be a plain replicated tensor with real values
            # (rope tables), which random pool data would misrepresent.
            raise NotImplementedError(f"{name} is a persistent buffer; only parameters are generated")
        if value.dim() == 0 or not value.dtype.is_floating_point:
            raise NotImplementedError(f"{name}: 0-d or non-floating parameters are not generated")
        specs.append(TensorSpec(name, tuple(value.shape), value.dtype))
    return state, specs


# ---------------------------------------------------------------- base (sparse safetensors)


def safetensors_header(specs: list[TensorSpec], metadata: Mapping[str, str] | None = None) -> tuple[bytes, int]:
    """(the 8-byte length + JSON header exactly as safetensors writes it, the data size)."""
    ordered = sorted(specs, key=lambda s: (-_SAFETENSORS_ORDER[s.dtype], s.name))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in ordered:
        header[spec.name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header with spaces to 8 bytes
    return struct.pack("<Q", len(text)) + text, offset


def write_sparse_safetensors(path: Path, specs: list[TensorSpec], metadata: Mapping[str, str]) -> int:
    """The header, then a hole as large as the data region: full apparent size, ~no disk."""
    head, data = safetensors_header(specs, metadata)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + data)
    return len(head) + data


def write_base(base_dir: Path, model: torch.nn.Module, specs: list[TensorSpec],
               max_shard_size: int | str = BASE_MAX_SHARD_SIZE) -> int:
    """A standalone transformer dir laid out as `save_pretrained(safe_serialization=True)` does."""
    from huggingface_hub import split_torch_state_dict_into_shards

    base_dir.mkdir(parents=True, exist_ok=True)
    model.save_config(base_dir)  # type: ignore[attr-defined]
    by_name = {s.name: s for s in specs}
    split = split_torch_state_dict_into_shards(
        model.state_dict(), max_shard_size=max_shard_size,
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
    )
    total = 0
    for filename, names in split.filename_to_tensors.items():
        total += write_sparse_safetensors(base_dir / filename, [by_name[n] for n in names], {"format": "pt"})
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        (base_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return total


# ---------------------------------------------------------------- the whole checkpoint


def _manifest(world_size: int, dtype: torch.dtype, config: Mapping[str, Any], seed: int,
              class_name: str, max_shard_size: int | str) -> dict[str, Any]:
    return {"class_name": class_name, "config": json.loads(json.dumps(dict(config))),
            "world_size": world_size, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
            "pool_elements": POOL_ELEMENTS, "base_max_shard_size": max_shard_size}


def load_complete(root: Path, *, world_size: int = 8, dtype: torch.dtype = torch.bfloat16,
                  config: Mapping[str, Any] = FLUX_DEV_CONFIG, seed: int = 0,
                  class_name: str = CLASS_NAME,
                  base_max_shard_size: int | str = BASE_MAX_SHARD_SIZE) -> Generated | None:
    """The checkpoint under `root` if a finished generation with these parameters is there."""
    root = Path(root)
    try:
        recorded = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    wanted = _manifest(world_size, dtype, config, seed, class_name, base_max_shard_size)
    if {k: recorded.get(k) for k in wanted} != wanted:
        return None
    files = tuple(root / "actor" / name for name in recorded["rank_files"])
    for path, size in zip(files, recorded["rank_sizes"]):
        if not path.is_file() or path.stat().st_size != size:
            return None
    return Generated(root, root / "actor", root / "base", files, world_size, sum(recorded["rank_sizes"]),
                     recorded["base_bytes"], recorded["tensor_bytes"], recorded["seconds"])


def generate(root: Path, *, world_size: int = 8, dtype: torch.dtype = torch.bfloat16,
             config: Mapping[str, Any] = FLUX_DEV_CONFIG, seed: int = 0,
             class_name: str = CLASS_NAME, base_max_shard_size: int | str = BASE_MAX_SHARD_SIZE,
             progress: Callable[[int, Path, float], None] | None = None) -> Generated:
    """Write ROOT/actor (W rank files + configs), ROOT/base (sparse) and ROOT/generated.json."""
    start = time.perf_counter()
    root = Path(root)
    if (root / "actor").exists() or (root / "base").exists():
        raise FileExistsError(f"{root} already holds actor/ or base/; remove them or pick another root")
    (root / MANIFEST).unlink(missing_ok=True)
    model = meta_model(class_name, config, dtype)
    template, specs = tensor_specs(model)
    source = WeightSource(seed, dtype)
    actor_dir = root / "actor"
    actor_dir.mkdir(parents=True)
    files = write_rank_files(actor_dir, template, specs, world_size, source, progress)
    (actor_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4))
    model.save_config(actor_dir / "huggingface")  # type: ignore[attr-defined]
    base_bytes = write_base(root / "base", model, specs, base_max_shard_size)
    sizes = [p.stat().st_size for p in files]
    seconds = time.perf_counter() - start
    tensor_bytes = sum(s.nbytes for s in specs)
    record = _manifest(world_size, dtype, config, seed, class_name, base_max_shard_size) | {
        "rank_files": [p.name for p in files], "rank_sizes": sizes, "base_bytes": base_bytes,
        "tensor_bytes": tensor_bytes, "tensors": len(specs), "seconds": seconds,
    }
    # Last: its presence means every file above is complete.
    (root / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    return Generated(root, actor_dir, root / "base", tuple(files), world_size, sum(sizes),
                     base_bytes, tensor_bytes, seconds)


def remove(root: Path) -> None:
    """Delete what `generate` wrote under root (and nothing else)."""
    root = Path(root)
    (root / MANIFEST).unlink(missing_ok=True)
    for sub in ("actor", "base"):
        shutil.rmtree(root / sub, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("-w", "--world-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="the tiny test Flux config instead of FLUX.1-dev")
    parser.add_argument("--force", action="store_true", help="remove an earlier generation under root first")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = getattr(torch, args.dtype)
    config: Mapping[str, Any] = FLUX_DEV_CONFIG
    if args.tiny:
        from mergeflow.demo.tiny_transformers import TINY_TRANSFORMER_CONFIGS

        config = TINY_TRANSFORMER_CONFIGS[CLASS_NAME]
    kwargs: dict[str, Any] = dict(world_size=args.world_size, dtype=dtype, config=config, seed=args.seed)
    if not args.force and (done := load_complete(args.root, **kwargs)) is not None:
        print(f"already complete: {done.root} ({done.rank_bytes / 1e9:.2f} GB of rank files)")
        return 0
    if args.force:
        remove(args.root)
    peak = [status_kb()[1]]

    def progress(rank: int, path: Path, seconds: float) -> None:
        peak[0] = max(peak[0], status_kb()[1])
        size = path.stat().st_size
        print(f"rank {rank}: {size / 1e9:.2f} GB in {seconds:.1f} s ({size / seconds / 1e6:.0f} MB/s), "
              f"private {status_kb()[1] / 1024:.0f} MiB", file=sys.stderr, flush=True)

    result = generate(args.root, progress=progress, **kwargs)
    print(json.dumps({"root": str(result.root), "rank_bytes": result.rank_bytes, "tensor_bytes": result.tensor_bytes,
                      "base_apparent_bytes": result.base_bytes, "seconds": round(result.seconds, 2),
                      "write_MBps": round(result.rank_bytes / result.seconds / 1e6, 1),
                      "peak_private_MiB_sampled": round(peak[0] / 1024, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
