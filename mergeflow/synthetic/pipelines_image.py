"""Tiny, offline, real base pipeline directories for the image architectures (Qwen-Image, SD3, Flux).

The caller passes a ready tiny Diffusers transformer; every other component is built tiny and
random (seeded, so two builds are identical), sized from ``transformer.config``, and the whole
pipeline is written with ``save_pretrained`` (safetensors) plus LICENSE and README.md extras,
so ``DiffusionPipeline.from_pretrained(root, local_files_only=True)`` loads it as its own class.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from mergeflow.synthetic.components import (
    autoencoder_kl,
    clip_text_encoder,
    qwen_image_vae,
    qwen25_vl_text_encoder,
    seeded,
    t5_encoder,
    write_extras,
)
from mergeflow.errors import UsageError
from mergeflow.synthetic.qwen_processor import load_edit_processor, write_edit_processor
from mergeflow.synthetic.tokenizers import save_clip_tokenizer, save_qwen2_tokenizer, save_t5_tokenizer

QWEN_IMAGE_VARIANTS: dict[str, str] = {
    "base": "QwenImagePipeline",
    "edit": "QwenImageEditPipeline",
    "edit_plus": "QwenImageEditPlusPipeline",
}

# Scheduler settings of the released models (only the class and these knobs matter here).
_QWEN_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
_FLUX_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
_SD3_SCHEDULER: dict[str, Any] = {"shift": 3.0}


def _hand_written(component: Any, folder: Path) -> Any:
    """Make ``component`` save by copying ``folder``, the from-scratch files it was loaded from."""

    # Tokenizers and processors are written from scratch, never re-serialised: transformers 5
    # drops vocab.json/merges.txt when saving, and cannot save a Qwen2VLProcessor without
    # torchvision. Diffusers calls each component's own save_pretrained, so this instance's
    # method copies the original folder instead.
    def save_pretrained(save_directory: str) -> None:
        shutil.copytree(folder, save_directory, dirs_exist_ok=True)

    component.save_pretrained = save_pretrained
    return component


def _tokenizer(cls: type, write: Any, scratch: Path, name: str) -> Any:
    """Write a tiny tokenizer folder with ``write`` under ``scratch`` and load it as ``cls``."""
    folder = write(scratch / name)
    return _hand_written(cls.from_pretrained(folder, local_files_only=True), folder)


def _save(pipe: Any, root: Path) -> Path:
    """Save ``pipe`` as safetensors under ``root`` with the LICENSE/README extras; return root."""
    root.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)
    write_extras(root, type(pipe).__name__)
    return root


def build_qwenimage_pipeline(root: Path, transformer: Any, *, variant: str = "base") -> Path:
    """Write a tiny Qwen-Image pipeline (base, edit or edit_plus) around ``transformer``."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    if variant not in QWEN_IMAGE_VARIANTS:
        known = ", ".join(sorted(QWEN_IMAGE_VARIANTS))
        raise UsageError(f"unknown Qwen-Image variant {variant!r}; choose one of: {known}")
    config = transformer.config
    # The pipeline packs 2x2 latent patches into the transformer's input channels.
    z_dim = max(1, config.in_channels // 4)
    root = Path(root)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _tokenizer(Qwen2Tokenizer, save_qwen2_tokenizer, Path(scratch), "tokenizer")
        components: dict[str, Any] = {
            "transformer": transformer,
            "vae": qwen_image_vae(z_dim),
            "text_encoder": qwen25_vl_text_encoder(config.joint_attention_dim, tokenizer),
            "tokenizer": tokenizer,
            "scheduler": FlowMatchEulerDiscreteScheduler(**_QWEN_SCHEDULER),
        }
        pipeline_cls = getattr(diffusers, QWEN_IMAGE_VARIANTS[variant])
        if variant == "base":
            return _save(pipeline_cls(**components), root)
        folder = write_edit_processor(Path(scratch) / "processor")
        processor = _hand_written(load_edit_processor(folder), folder)
        return _save(pipeline_cls(processor=processor, **components), root)


def build_sd3_pipeline(root: Path, transformer: Any) -> Path:
    """Write a tiny StableDiffusion3Pipeline (two CLIPs with projection, T5, VAE) around ``transformer``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5Tokenizer

    config = transformer.config
    # Pooled embeddings of the two CLIPs are concatenated into pooled_projection_dim; like the
    # released models each CLIP's hidden size equals its projection size.
    first = config.pooled_projection_dim // 2
    second = config.pooled_projection_dim - first
    root = Path(root)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _tokenizer(CLIPTokenizer, save_clip_tokenizer, Path(scratch), "tokenizer")
        tokenizer_3 = _tokenizer(T5Tokenizer, save_t5_tokenizer, Path(scratch), "tokenizer_3")
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(**_SD3_SCHEDULER),
            vae=autoencoder_kl(config.in_channels, scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=clip_text_encoder(CLIPTextModelWithProjection, first, first, tokenizer, seed=1),
            tokenizer=tokenizer,
            text_encoder_2=clip_text_encoder(CLIPTextModelWithProjection, second, second, tokenizer, seed=2),
            tokenizer_2=tokenizer,
            text_encoder_3=t5_encoder(config.joint_attention_dim, tokenizer_3),
            tokenizer_3=tokenizer_3,
        )
        return _save(pipe, root)


def build_flux_pipeline(root: Path, transformer: Any) -> Path:
    """Write a tiny FluxPipeline (CLIP, T5, VAE) around ``transformer``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextModel, CLIPTokenizer, T5Tokenizer

    config = transformer.config
    # Flux feeds CLIP's pooled output (hidden size) as the pooled projection, T5's states as context.
    pooled = config.pooled_projection_dim
    root = Path(root)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _tokenizer(CLIPTokenizer, save_clip_tokenizer, Path(scratch), "tokenizer")
        tokenizer_2 = _tokenizer(T5Tokenizer, save_t5_tokenizer, Path(scratch), "tokenizer_2")
        pipe = FluxPipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER),
            vae=autoencoder_kl(max(1, config.in_channels // 4), scaling_factor=0.3611, shift_factor=0.1159),
            text_encoder=clip_text_encoder(CLIPTextModel, pooled, pooled, tokenizer, seed=1),
            tokenizer=tokenizer,
            text_encoder_2=t5_encoder(config.joint_attention_dim, tokenizer_2),
            tokenizer_2=tokenizer_2,
        )
        return _save(pipe, root)


def tiny_qwenimage_transformer() -> Any:
    """Return a seeded tiny QwenImageTransformer2DModel matching build_qwenimage_pipeline's sizes."""
    from diffusers import QwenImageTransformer2DModel

    with seeded(0):
        return QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
        )


def tiny_sd3_transformer() -> Any:
    """Return a seeded tiny SD3Transformer2DModel matching build_sd3_pipeline's sizes."""
    from diffusers import SD3Transformer2DModel

    with seeded(0):
        return SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
            pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
        )


def tiny_flux_transformer(guidance_embeds: bool = True) -> Any:
    """Return a seeded tiny FluxTransformer2DModel (guidance-distilled by default, like FLUX.1-dev)."""
    from diffusers import FluxTransformer2DModel

    with seeded(0):
        return FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
        )
