"""The runtime check's loaders, per output (mergeflow/ops/smoke.py runs the step and checks it).

Pipelines load with DiffusionPipeline (a modular one: its trained transformer), transformers with their
class, single files (plain, FP8, GGUF) and LoRA adapters as below.

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
from mergeflow.ops.smoke import RuntimeCheckError, pipeline_step, transformer_step


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


def load_and_step(root: Path, manifest: Mapping[str, Any], device: str, dtype: Any, base: Path | None,
                   trust_remote_code: bool) -> tuple[str, str, dict[str, Any]]:
    import diffusers

    kind = manifest["artifact_type"]
    if (root / "model_index.json").is_file():
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(root), torch_dtype=dtype, local_files_only=True,
                                                           trust_remote_code=trust_remote_code).to(device)
        return f"DiffusionPipeline ({type(pipe).__name__})", "pipeline, 1 step", pipeline_step(pipe, device)
    if (root / "modular_model_index.json").is_file():
        # A modular pipeline's blocks take their own inputs (no one-call text-to-video entry): its trained
        # denoiser, loaded by its class from the artifact, runs the step alone.
        index = json.loads((root / "modular_model_index.json").read_text())
        component = next(n for n in ("transformer",) if n in index)
        config = json.loads((root / component / "config.json").read_text())
        cls = getattr(diffusers, config["_class_name"])
        model = cls.from_pretrained(str(root / component), torch_dtype=dtype, local_files_only=True).to(device)
        return (f"{cls.__name__}.from_pretrained ({component}/ of the modular pipeline)",
                "transformer forward (a modular pipeline has no one-call step)", transformer_step(model, device, dtype))
    if kind == "minimax_h3_pipeline":
        raise RuntimeCheckError("no runtime check for MiniMax H3's native package: its transformer is the package's own "
                                "MiniMaxH3DiTModel, which Diffusers does not load")
    if kind == "diffusers_transformer":
        cls = getattr(diffusers, json.loads((root / "config.json").read_text())["_class_name"])
        model = cls.from_pretrained(str(root), torch_dtype=dtype, local_files_only=True).to(device)
        return f"{cls.__name__}.from_pretrained", "transformer forward", transformer_step(model, device, dtype)
    if kind in ("single_file", "gguf"):
        model, loaded_as = load_single_file(root, manifest, dtype)
        return loaded_as, "transformer forward", transformer_step(model.to(device), device, dtype)
    if manifest.get("lora_adapter") is not None:
        model, loaded_as = load_adapter(root, manifest, base, dtype)
        return loaded_as, "transformer forward", transformer_step(model.to(device), device, dtype)
    raise RuntimeCheckError(f"no runtime check for artifact type {kind!r}")
