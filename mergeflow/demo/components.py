"""Tiny, seeded, random components of the demo's base pipeline (Qwen-Image), and the base's extras.

The tests' synthetic pipelines use the same builders (tests/fixtures/components.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mergeflow.demo.tokenizers import QWEN2_SPECIAL_TOKENS

# Qwen2.5-VL's vision tower: 14 px patches, 2x2 spatial merge, 2 frames per temporal patch
# (the tests' tiny image processor uses the same sizes).
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2

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


def qwen_image_vae(z_dim: int, *, seed: int = 4, spatial_factor: int = 4) -> Any:
    """Build a tiny AutoencoderKLQwenImage with ``z_dim`` latent channels (spatial factor 4, or 8 as released).

    Factor 8 is for pipelines that encode an input image: the editing pipelines resize it to about a
    megapixel, and at factor 4 the VAE's mid-block attention runs over 65,536 latent positions.
    """
    from diffusers import AutoencoderKLQwenImage

    if spatial_factor not in (4, 8):
        raise ValueError(f"spatial_factor is 4 or 8, not {spatial_factor}")
    stages = 2 if spatial_factor == 4 else 3
    with seeded(seed):
        return AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 2, 4, 4][: stages + 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True][:stages],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        ).eval()
