"""Tiny, seeded, random pipeline components (text encoders, VAEs) and the base extras.

Each builder takes the few dimensions the transformer dictates and picks everything else as
small as the model class allows, so synthetic pipelines load and run in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mergeflow.synthetic.qwen_processor import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE
from mergeflow.synthetic.tokenizers import QWEN2_SPECIAL_TOKENS

LICENSE_TEXT = (
    "Synthetic test model, built from random weights by mergeflow's test fixtures.\n"
    "Released under CC0 1.0: no rights reserved.\n"
)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU RNG seeded to ``seed``; the caller's RNG state is restored."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def write_extras(root: Path, pipeline_class: str) -> None:
    """Write the LICENSE and README.md that a real base pipeline carries beside its components."""
    (root / "LICENSE").write_text(LICENSE_TEXT, encoding="utf-8")
    readme = (
        f"# Tiny synthetic {pipeline_class}\n\n"
        "Random weights, built offline for tests. Not a usable model.\n"
    )
    (root / "README.md").write_text(readme, encoding="utf-8")


def _vocab_size(tokenizer: Any) -> int:
    """Embedding rows needed for every id ``tokenizer`` can emit (added tokens included)."""
    return len(tokenizer)


def _heads(width: int, *, min_head_dim: int = 4) -> int:
    """Pick 2 attention heads when ``width`` splits into even heads of a useful size, else 1."""
    return 2 if width % 4 == 0 and width // 2 >= min_head_dim else 1


def clip_text_encoder(cls: type, hidden: int, projection: int, tokenizer: Any, *, seed: int) -> Any:
    """Build a tiny CLIP text model of class ``cls`` (with or without projection)."""
    from transformers import CLIPTextConfig

    config = CLIPTextConfig(
        vocab_size=_vocab_size(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection,
        num_hidden_layers=2,  # SD3 reads the penultimate hidden state
        num_attention_heads=_heads(hidden),
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act="quick_gelu",
        # CLIP pools at the first eos id, so the ids must be the tokenizer's.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed):
        return cls(config).eval()


def t5_encoder(d_model: int, tokenizer: Any, *, cls: type | None = None, seed: int = 3) -> Any:
    """Build a tiny T5-style encoder (T5EncoderModel unless ``cls`` says e.g. UMT5EncoderModel)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config

    model_cls = cls or T5EncoderModel
    config_cls = UMT5Config if model_cls.__name__.startswith("UMT5") else T5Config
    config = config_cls(
        vocab_size=_vocab_size(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed):
        return model_cls(config).eval()


def _mrope_section(head_dim: int) -> list[int]:
    """Split half of a head (temporal, height, width) the way Qwen2.5-VL's multimodal RoPE needs."""
    half = head_dim // 2
    return [half - 2 * (half // 3), half // 3, half // 3]


def qwen25_vl_text_encoder(hidden: int, tokenizer: Any, *, seed: int = 1) -> Any:
    """Build a tiny Qwen2_5_VLForConditionalGeneration whose text width is ``hidden``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = _heads(hidden, min_head_dim=6)
    # An odd width leaves an odd RoPE head: the model still builds, saves and loads (all a
    # base pipeline fixture needs), but only even widths can run text through it.
    head_dim = hidden // heads
    ids = dict(zip(QWEN2_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN2_SPECIAL_TOKENS))))
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": _vocab_size(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 2048,
            "max_window_layers": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": _mrope_section(head_dim),
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "window_size": PATCH_SIZE * MERGE_SIZE * 2,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    with seeded(seed):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_image_vae(z_dim: int, *, seed: int = 4) -> Any:
    """Build a tiny AutoencoderKLQwenImage with ``z_dim`` latent channels (spatial factor 4)."""
    from diffusers import AutoencoderKLQwenImage

    with seeded(seed):
        return AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        ).eval()


def autoencoder_kl(latent_channels: int, *, scaling_factor: float, shift_factor: float, seed: int = 4) -> Any:
    """Build a tiny AutoencoderKL (spatial factor 2, no quant convs, like the SD3/Flux VAEs)."""
    from diffusers import AutoencoderKL

    with seeded(seed):
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=32,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).eval()
