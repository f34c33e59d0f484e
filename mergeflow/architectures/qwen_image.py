"""Qwen-Image (and Edit): the original single-file layout is Diffusers' own names.

Diffusers' `from_single_file` maps a Qwen-Image checkpoint with the identity
(`single_file_model.py`: `lambda checkpoint, **kwargs: checkpoint`), and ComfyUI's Qwen-Image
checkpoints use the same keys, so the single file holds every tensor under its Diffusers name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergeflow.architectures.quantization import FP8Rule
from mergeflow.architectures.original_layout import (
    OriginalLayout,
    OriginalTensor,
    Shape,
)


def plan(shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    return [OriginalTensor(name, (name,)) for name in sorted(shapes)]


ORIGINAL = OriginalLayout(
    name="qwen_image",
    transformer_classes=("QwenImageTransformer2DModel",),
    plan=plan,
    architecture=lambda config: "qwen-image",
    implementation="https://github.com/QwenLM/Qwen-Image",
    # --quantize fp8: the blocks' linear weights; modulation and norms stay bf16 (see quantization.py).
    fp8=FP8Rule(blocks=r"transformer_blocks\.\d+\.", keep=r"_mod\.|norm"),
)
