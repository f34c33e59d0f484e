"""Tiny, offline MiniMax H3 base packages in both deployed layouts.

Training uses Diffusers' ``MiniMaxH3Transformer3DModel``; deployments use either
(a) Diffusers' modular layout: ``modular_model_index.json`` naming ``MiniMaxH3ModularPipeline``
    with components ``transformer``, ``transformer_ref``, ``vae``, ``audio_vae``, ``scheduler``,
    ``audio_scheduler``, ``text_encoder``, ``tokenizer``, ``processor``; or
(b) the native package: ``model_index.json`` naming ``MiniMaxH3Pipeline`` with a ``_minimax_h3``
    metadata dict, a ``MiniMaxH3DiTModel`` transformer in ``model.safetensors`` (converted by the
    reference conversion of :mod:`mergeflow.synthetic.minimax_h3_reference`), a text encoder,
    video/audio VAEs, processor and tokenizer, and no scheduler.
Every other component is tiny, random and seeded; dimensions come from ``transformer.config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from mergeflow.synthetic.components import seeded, write_extras
from mergeflow.synthetic.minimax_h3_reference import (
    native_config_from_diffusers,
    native_tensor_shapes,
    reference_native_state_dict,
)
from mergeflow.synthetic.qwen3vl import qwen3vl_model, write_qwen3vl_processor
from mergeflow.synthetic.tokenizers import save_qwen2_tokenizer

__all__ = [
    "H3_TEXT_ENCODER_LAYERS",
    "MODULAR_REPO_ID",
    "NATIVE_METADATA",
    "build_minimax_h3_modular",
    "build_minimax_h3_native",
    "native_config_from_diffusers",
    "native_tensor_shapes",
    "reference_native_state_dict",
]

# The modular index names the Hub repository its components come from; Diffusers loads the
# local copy instead whenever a component's files are present (as after `hf download --local-dir`),
# so no local path ever goes into the index.
MODULAR_REPO_ID = "MiniMaxAI/MiniMax-H3"
# MiniMax H3 conditions on hidden_states[50] of its Qwen3-VL and needs that state pre-norm, so
# the tower must have more than 50 decoder layers.
H3_TEXT_ENCODER_LAYERS = 51
# The native release writes this metadata into model_index.json (FL2VA partition).
NATIVE_METADATA: dict[str, Any] = {
    "partition": "fl2va",
    "schema_version": 1,
    "sigma_shift_scales": {"audio": 3.0, "video": 12.0},
    "task_aliases": {},
    "tasks": ["t2va", "fl2va"],
}
_NATIVE_DIFFUSERS_VERSION = "0.32.2"  # what the native release's configs carry
# Canvas rules of the modular blocks, shrunk to the tiny VAE (4x spatial compression).
_MODULAR_CANVAS: dict[str, int] = {
    "canvas_max_pixels": 32 * 56,
    "canvas_short_edge": 32,
    "reference_image_short_edge": 64,
}


def h3_video_vae(latent_channels: int, *, seed: int = 4) -> Any:
    """Build a tiny AutoencoderKLMiniMaxH3 (released 17-frame chunking, 4x spatial compression)."""
    from diffusers import AutoencoderKLMiniMaxH3

    with seeded(seed):
        return AutoencoderKLMiniMaxH3(
            latent_channels=latent_channels,
            block_out_channels=(8, 16),
            layers_per_block=1,
            spatial_downsample_factors=(2, 2),
            temporal_downsample_factors=(2, 2),
            norm_num_groups=8,
            decoder_num_layers=2,
            decoder_num_attention_heads=2,
            decoder_attention_head_dim=8,
            decoder_num_register_tokens=2,
            decoder_ffn_mult=2,
            latents_mean=(0.0,) * latent_channels,
            latents_std=(1.0,) * latent_channels,
        ).eval()


def h3_audio_vae(latent_channels: int, *, seed: int = 6) -> Any:
    """Build a tiny AutoencoderKLMiniMaxH3Audio (4 samples per latent, 32 kHz)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    with seeded(seed):
        return AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4,
            encoder_rates=(2, 2),
            latent_dim=32,
            latent_channels=latent_channels,
            num_attention_heads=2,
            decoder_dim=16,
            decoder_rates=(2, 2),
            decoder_kernel_sizes=(4, 4),
            resblock_kernel_sizes=(3, 7),
            resblock_dilation_sizes=((1, 3), (1, 3)),
            latents_mean=[0.0] * latent_channels,
            latents_std=[1.0] * latent_channels,
        ).eval()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented, key-sorted JSON (the layout Diffusers writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_text_side(root: Path, text_dim: int) -> None:
    """Write tokenizer, processor and the tiny Qwen3-VL text encoder shared by both layouts."""
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(save_qwen2_tokenizer(root / "tokenizer"), local_files_only=True)
    write_qwen3vl_processor(root / "processor")
    qwen3vl_model(text_dim, tokenizer, num_layers=H3_TEXT_ENCODER_LAYERS).save_pretrained(root / "text_encoder")


def _ref_partition(transformer: Any, *, seed: int = 8) -> Any:
    """A Ref2VA partition for ``transformer``: same architecture and per-tensor dtypes, its own weights."""
    dtypes = {name: param.dtype for name, param in transformer.named_parameters()}
    with seeded(seed):
        ref = type(transformer).from_config(transformer.config).eval()
    for name, param in ref.named_parameters():
        param.data = param.data.to(dtypes[name])
    return ref


def _modular_entry(library: str, class_name: str, subfolder: str) -> list[Any]:
    """One from_pretrained component of modular_model_index.json, as ModularPipeline writes it."""
    spec = {
        "pretrained_model_name_or_path": MODULAR_REPO_ID,
        "revision": None,
        "subfolder": subfolder,
        "type_hint": [library, class_name],
        "variant": None,
    }
    return [library, class_name, spec]


def build_minimax_h3_modular(root: Path, transformer: Any, transformer_ref: Any | None = None) -> Path:
    """Write a tiny MiniMax H3 modular repository (``transformer`` + ``transformer_ref`` partitions)."""
    import diffusers
    from diffusers import MiniMaxH3Scheduler

    config = transformer.config
    root = Path(root)
    if transformer_ref is None:
        transformer_ref = _ref_partition(transformer)
    _write_text_side(root, config.text_dim)
    models: dict[str, Any] = {
        "transformer": transformer,
        "transformer_ref": transformer_ref,
        "vae": h3_video_vae(config.in_channels),
        "audio_vae": h3_audio_vae(config.audio_in_channels),
        # Two flow schedulers stepped inside one call: shift 12 for video, 3 for audio.
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    index: dict[str, Any] = {
        "_blocks_class_name": "MiniMaxH3Blocks",
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": diffusers.__version__,
        **_MODULAR_CANVAS,
        "text_encoder": _modular_entry("transformers", "Qwen3VLForConditionalGeneration", "text_encoder"),
        "tokenizer": _modular_entry("transformers", "Qwen2TokenizerFast", "tokenizer"),
        "processor": _modular_entry("transformers", "Qwen3VLProcessor", "processor"),
    }
    for name, model in models.items():
        index[name] = _modular_entry("diffusers", type(model).__name__, name)
    _write_json(root / "modular_model_index.json", index)
    write_extras(root, "MiniMaxH3ModularPipeline")
    return root


def _write_native_vae(directory: Path, model: Any, class_name: str) -> None:
    """Save a tiny VAE's weights under the native class name, with its constructor fields as config."""
    fields = {key: value for key, value in dict(model.config).items() if not key.startswith("_")}
    config = {"_class_name": class_name, "_diffusers_version": _NATIVE_DIFFUSERS_VERSION, **fields}
    _write_json(directory / "config.json", config)
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    save_file(state, str(directory / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})


def build_minimax_h3_native(root: Path, transformer: Any) -> Path:
    """Write a tiny native MiniMax H3 package whose ``transformer/`` is the converted ``transformer``."""
    config = dict(transformer.config)
    root = Path(root)
    native_config = {**native_config_from_diffusers(config), "_diffusers_version": _NATIVE_DIFFUSERS_VERSION}
    _write_json(root / "transformer" / "config.json", native_config)
    native = reference_native_state_dict(transformer.state_dict(), config)
    state = {key: tensor.detach().contiguous() for key, tensor in native.items()}
    save_file(state, str(root / "transformer" / "model.safetensors"), metadata={"format": "pt"})
    _write_text_side(root, config["text_dim"])
    _write_native_vae(root / "video_vae", h3_video_vae(config["in_channels"]), "MiniMaxH3VideoVAE")
    _write_native_vae(root / "audio_vae", h3_audio_vae(config["audio_in_channels"]), "MiniMaxH3AudioVAE")
    index = {
        "_class_name": "MiniMaxH3Pipeline",
        "_diffusers_version": _NATIVE_DIFFUSERS_VERSION,
        "_minimax_h3": NATIVE_METADATA,
        "audio_vae": ["diffusers", "MiniMaxH3AudioVAE"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        # The native release declares no scheduler: sigma_shift_scales drive its sampler.
        "scheduler": None,
        "text_encoder": ["transformers", "MiniMaxH3Qwen3VLHFEncoder"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "MiniMaxH3DiTModel"],
        "video_vae": ["diffusers", "MiniMaxH3VideoVAE"],
    }
    _write_json(root / "model_index.json", index)
    write_extras(root, "MiniMaxH3Pipeline")
    return root
