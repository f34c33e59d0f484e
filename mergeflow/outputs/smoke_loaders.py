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


def load_minimax_h3_native(root: Path, manifest: Mapping[str, Any], dtype: Any) -> tuple[Any, str]:
    """The native package's `transformer/` (MiniMaxH3DiTModel, which Diffusers has no class for) as Diffusers'
    MiniMaxH3Transformer3DModel: its weights through Diffusers' own native converter, the one `from_single_file`
    runs, in the QKV row order the export declared; every tensor of the model must come from the file."""
    import torch
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from mergeflow.architectures.minimax_h3 import diffusers_config

    native = json.loads((root / "transformer" / "config.json").read_text())
    layout = ((manifest.get("config_transform") or {}).get("tensor_conversion") or {}).get("qkv_layout")
    if layout is None:
        raise RuntimeCheckError("the manifest does not say which QKV row order the native transformer holds")
    shards = sorted(n for n in manifest["files"] if n.startswith("transformer/") and n.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    for name in shards:
        state.update(load_file(str(root / name)))
    config = diffusers_config(native)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(state, config, qkv_layout=layout)
    model = MiniMaxH3Transformer3DModel.from_config(config)
    model.load_state_dict(converted, strict=True, assign=True)
    return (model.to(dtype).eval(),
            f"MiniMaxH3Transformer3DModel via Diffusers' native converter (qkv_layout={layout}; no Diffusers class "
            "loads MiniMaxH3DiTModel)")


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


def _custom_pipeline(root: Path, trust_remote_code: bool) -> dict[str, Any]:
    """`custom_pipeline` for a pipeline whose class is the artifact's own code (Boogu-Image's pipeline.py): Diffusers
    imports it from there only when asked, and only with --trust-remote-code (as the export copied it)."""
    import diffusers

    name = json.loads((root / "model_index.json").read_text()).get("_class_name")
    if hasattr(diffusers, str(name)) or not (root / "pipeline.py").is_file():
        return {}
    if not trust_remote_code:
        raise UsageError(f"the pipeline class {name} is the artifact's own code (pipeline.py); "
                         "run the check with --trust-remote-code to let Diffusers import it")
    return {"custom_pipeline": str(root)}


def load_and_step(root: Path, manifest: Mapping[str, Any], device: str, dtype: Any, base: Path | None,
                  trust_remote_code: bool,
                  components: Mapping[str, Any] | None = None) -> tuple[str, str, dict[str, Any]]:
    import diffusers

    kind = manifest["artifact_type"]
    # Before the pipeline branch: the native package has a model_index.json that Diffusers cannot load.
    if kind == "minimax_h3_pipeline":
        model, loaded_as = load_minimax_h3_native(root, manifest, dtype)
        return (loaded_as, "transformer forward (the native package's transformer)",
                transformer_step(model.to(device), device, dtype))
    if (root / "model_index.json").is_file():
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(root), torch_dtype=dtype, local_files_only=True,
                                                           trust_remote_code=trust_remote_code,
                                                           **_custom_pipeline(root, trust_remote_code),
                                                           **dict(components or {})).to(device)
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
