"""Tiny Qwen3-VL pieces (model, processor folder) shared by the MiniMax H3 and Boogu fixtures.

Both architectures condition on a Qwen3-VL language tower and ship a ``Qwen3VLProcessor``.
In transformers 5.x that processor cannot be built, saved or loaded without torchvision (its
video processor needs it), so its folder is written by hand (image-processor config, video
processor config, chat template, tokenizer files) and :func:`load_qwen3vl_processor` builds it
with ``video_processor=None`` allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mergeflow.synthetic.components import seeded
from mergeflow.synthetic.qwen_processor import video_processor_optional
from mergeflow.synthetic.tokenizers import QWEN2_SPECIAL_TOKENS, save_qwen2_tokenizer

# Qwen3-VL's vision geometry (16 px patches, 2x2 merge, 2-frame temporal patches); images are
# capped at 128x128 so the tiny vision tower runs in milliseconds.
PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
_MIN_PIXELS = 64 * 64
_MAX_PIXELS = 128 * 128
# Text attention geometry of every tiny tower: the head size is independent of the hidden size
# in Qwen3-VL, so any hidden size (even an odd one) works.
_TEXT_HEADS = 2
_TEXT_KV_HEADS = 1
_TEXT_HEAD_DIM = 8

_IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": MERGE_SIZE,
    "patch_size": PATCH_SIZE,
    "processor_class": "Qwen3VLProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": _MAX_PIXELS, "shortest_edge": _MIN_PIXELS},
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
}
_VIDEO_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": True,
    "fps": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_frames": 8,
    "merge_size": MERGE_SIZE,
    "min_frames": 2,
    "patch_size": PATCH_SIZE,
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": _MAX_PIXELS * 2, "shortest_edge": _MIN_PIXELS},
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "video_processor_type": "Qwen3VLVideoProcessor",
}
# A compact chat template in Qwen3-VL's format: text and image parts, vision blocks inline.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3vl_model(hidden: int, tokenizer: Any, *, num_layers: int = 2, seed: int = 1) -> Any:
    """Build a tiny Qwen3VLForConditionalGeneration whose text hidden size is ``hidden``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = dict(zip(QWEN2_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN2_SPECIAL_TOKENS))))
    half = _TEXT_HEAD_DIM // 2
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 16,
            "num_hidden_layers": num_layers,
            "num_attention_heads": _TEXT_HEADS,
            "num_key_value_heads": _TEXT_KV_HEADS,
            "head_dim": _TEXT_HEAD_DIM,
            "max_position_embeddings": 2048,
            # Multimodal RoPE splits half a head over (t, h, w).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                "mrope_interleaved": True,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "out_hidden_size": hidden,
            "num_position_embeddings": 16,  # a 4x4 grid of learned positions
            "deepstack_visual_indexes": [],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with seeded(seed):
        return Qwen3VLForConditionalGeneration(config).eval()


def write_qwen3vl_processor(directory: Path | str) -> Path:
    """Write a Qwen3VLProcessor folder by hand (processor configs, chat template, tokenizer); return it."""
    directory = Path(directory)
    save_qwen2_tokenizer(directory)
    files = {
        "preprocessor_config.json": _IMAGE_PROCESSOR_CONFIG,
        "video_preprocessor_config.json": _VIDEO_PROCESSOR_CONFIG,
    }
    for name, config in files.items():
        (directory / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return directory


def load_qwen3vl_processor(directory: Path | str) -> Any:
    """Build the Qwen3VLProcessor of a processor folder offline (no video processor: no torchvision)."""
    from transformers import AutoImageProcessor, Qwen2Tokenizer, Qwen3VLProcessor

    directory = Path(directory)
    # Without torchvision AutoImageProcessor resolves to the PIL backend of the same processor.
    image_processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    tokenizer = Qwen2Tokenizer.from_pretrained(directory, local_files_only=True)
    template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    with video_processor_optional():
        return Qwen3VLProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template
        )
