"""The demo's base pipeline: a tiny, offline, real QwenImagePipeline around the demo's base transformer.

With a whole pipeline as its base, the demo can show the default `--output_format pipeline`
(every component but the transformer copied and verified) as well as `transformer`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from mergeflow.demo.components import (
    qwen25_vl_text_encoder,
    qwen_image_vae,
    write_extras,
)
from mergeflow.demo.tokenizers import save_qwen2_tokenizer

# Qwen-Image's released scheduler settings (only the class and these knobs matter here).
QWEN_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def saves_by_copying(component: Any, folder: Path) -> Any:
    """Make ``component`` save by copying ``folder``, the from-scratch files it was loaded from.

    Tokenizers are written from scratch, never re-serialised: transformers 5 drops
    vocab.json/merges.txt when saving. Diffusers calls each component's own save_pretrained,
    so this instance's method copies the original folder instead.
    """

    def save_pretrained(save_directory: str) -> None:
        shutil.copytree(folder, save_directory, dirs_exist_ok=True)

    component.save_pretrained = save_pretrained
    return component


# The tiny Qwen-Image transformer this pipeline's VAE and text encoder run with (`mergeflow smoke` runs
# one step of it): 2x2 patches of a 4-channel latent in, the latent's 4 channels out, and rotary axes
# that fill the attention head. The suite's smallest default config loads but does not run here.
RUNNABLE_QWEN_IMAGE: dict[str, Any] = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 16, "axes_dims_rope": (8, 4, 4),
}


def build_qwenimage_base(root: Path, transformer: Any) -> Path:
    """Write a tiny QwenImagePipeline (tokenizer, Qwen2.5-VL text encoder, VAE, scheduler) around ``transformer``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2Tokenizer

    config = transformer.config
    z_dim = max(1, config.in_channels // 4)  # the pipeline packs 2x2 latent patches into the input channels
    root = Path(root)
    with tempfile.TemporaryDirectory() as scratch:
        folder = save_qwen2_tokenizer(Path(scratch) / "tokenizer")
        tokenizer = saves_by_copying(Qwen2Tokenizer.from_pretrained(folder, local_files_only=True), folder)
        pipe = QwenImagePipeline(
            transformer=transformer,
            vae=qwen_image_vae(z_dim),
            text_encoder=qwen25_vl_text_encoder(config.joint_attention_dim, tokenizer),
            tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        )
        root.mkdir(parents=True, exist_ok=True)
        pipe.save_pretrained(root, safe_serialization=True)
    write_extras(root, type(pipe).__name__)
    return root
