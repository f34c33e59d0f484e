"""The runtime check's loaders for single files (plain, FP8, GGUF) and LoRA adapters.

A plain single file goes through Diffusers' own `from_single_file` (with the artifact's config.json). Where
Diffusers' converter cannot read it (its Flux converter hard-codes FLUX.1's width, so a narrow test model
fails), and for encoded files, the state is decoded and mapped back to Diffusers' names through the manifest's
`original_layout.key_map`, the map the export wrote and `test` proves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mergeflow.architectures.gguf_layout import STRIPPED_PREFIX
from mergeflow.architectures.original_layout import layout_for
from mergeflow.errors import UsageError


def _weights_file(root: Path, manifest: Mapping[str, Any]) -> Path:
    names = [n for n in manifest["files"] if n.endswith((".safetensors", ".gguf")) and "/" not in n]
    if len(names) != 1:
        raise UsageError(f"a single-file artifact holds one weights file, not {len(names)}")
    return root / names[0]


def _decoded_state(path: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The file's tensors under their single-file keys, decoded to float32 (GGUF dequantized, FP8 times its scale)."""
    import torch

    if path.suffix == ".gguf":
        import gguf
        import numpy as np

        key_map = manifest.get("original_layout", {}).get("key_map", {})
        original = {k.removeprefix(STRIPPED_PREFIX): k for k in key_map}
        reader = gguf.GGUFReader(path)
        state = {}
        for t in reader.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            field = reader.get_field(f"comfy.gguf.orig_shape.{t.name}")
            shape = [int(field.parts[i][0]) for i in field.data] if field is not None else list(reversed(t.shape.tolist()))
            state[original.get(t.name, t.name)] = torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).float()
        return state
    from safetensors.torch import load_file

    raw = load_file(str(path))
    state = {}
    for key, value in raw.items():
        if key.endswith((".weight_scale", ".scale_weight", ".scale_input")):
            continue
        scale = raw.get(key.removesuffix(".weight") + ".weight_scale", raw.get(key.removesuffix(".weight") + ".scale_weight"))
        state[key] = value.float() * scale.float() if scale is not None else value
    return state


def _from_key_map(cls: Any, config: Mapping[str, Any], state: Mapping[str, Any], key_map: Mapping[str, Any]) -> Any:
    import torch

    model = cls.from_config(dict(config))
    diffusers_state = {}
    for key, entries in key_map.items():
        for source, start, end, swapped in entries:
            part = state[key] if len(entries) == 1 else state[key][int(start):int(end)]
            diffusers_state[source] = torch.cat(part.chunk(2)[::-1]) if swapped else part
    model.load_state_dict(diffusers_state, strict=True, assign=True)
    return model


def load_single_file(root: Path, manifest: Mapping[str, Any], dtype: Any) -> tuple[Any, str]:
    import diffusers

    path = _weights_file(root, manifest)
    config = json.loads((root / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    key_map = (manifest.get("original_layout") or {}).get("key_map")
    encoded = manifest.get("quantization") is not None
    if not encoded:
        try:
            model = cls.from_single_file(str(path), config=str(root), local_files_only=True, torch_dtype=dtype,
                                         **layout_for(cls.__name__).loader_kwargs(config))
            return model.eval(), f"{cls.__name__}.from_single_file"
        except Exception as exc:  # Diffusers' converter cannot read every width: the key map can
            if not key_map:
                raise
            reason = f"from_single_file: {type(exc).__name__}"
    else:
        reason = f"{manifest['quantization'].get('method')} dequantized"
    state = _decoded_state(path, manifest)
    if key_map:
        model = _from_key_map(cls, config, state, key_map)
    else:
        model = cls.from_config(config)
        model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype).eval(), f"{cls.__name__} via the manifest's key map ({reason})"


def _base_transformer(base: Path, dtype: Any) -> tuple[Any, Any]:
    """(pipeline or None, transformer) of the local base an adapter is loaded onto."""
    import diffusers

    if (base / "model_index.json").is_file():
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(base), torch_dtype=dtype, local_files_only=True)
        return pipe, pipe.transformer
    config = json.loads((base / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    return None, cls.from_pretrained(str(base), torch_dtype=dtype, local_files_only=True)


def load_adapter(root: Path, manifest: Mapping[str, Any], base: Path | None, dtype: Any) -> tuple[Any, str]:
    """The base's transformer with the adapter loaded: PEFT's own loader, or Diffusers' load_lora_weights."""
    if base is None or not base.is_dir():
        raise UsageError("the runtime check of a LoRA adapter needs its base: --base_model DIR (a local pipeline or transformer)")
    adapter = manifest["lora_adapter"]
    pipe, transformer = _base_transformer(base, dtype)
    if adapter["format"] == "peft":
        from peft import PeftModel

        model = PeftModel.from_pretrained(transformer, str(root))
        return model.get_base_model().eval(), "PeftModel.from_pretrained onto the base transformer"
    weights = next(n for n in manifest["files"] if n.endswith(".safetensors"))
    if pipe is not None:
        pipe.load_lora_weights(str(root), weight_name=weights)
        return pipe.transformer.eval(), "load_lora_weights onto the base pipeline"
    transformer.load_lora_adapter(str(root), weight_name=weights, prefix="transformer")
    return transformer.eval(), "load_lora_adapter onto the base transformer"
