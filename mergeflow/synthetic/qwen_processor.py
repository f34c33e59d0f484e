"""A Qwen2VLProcessor for tiny Qwen-Image Edit pipelines, without torchvision.

In transformers 5.x ``Qwen2VLProcessor`` insists on a video processor, and the only video
processor needs torchvision, which does not work with the CPU torch here. The processor is
therefore built with the class check relaxed for ``video_processor=None`` (and restored
afterwards); its folder is written by hand (image-processor config + tokenizer files), and
Edit pipelines are loaded with ``processor=load_edit_processor(...)`` passed in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mergeflow.synthetic.tokenizers import save_qwen2_tokenizer

# The image processor keeps images tiny (at most 8x8 patches of 14 px) so the vision tower
# of a tiny text encoder runs in milliseconds; patch/merge sizes match the vision config.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 112 * 112

_IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_pixels": _MAX_PIXELS,
    "merge_size": MERGE_SIZE,
    "min_pixels": _MIN_PIXELS,
    "patch_size": PATCH_SIZE,
    "processor_class": "Qwen2VLProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": _MAX_PIXELS, "shortest_edge": _MIN_PIXELS},
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
}


@contextmanager
def video_processor_optional() -> Iterator[None]:
    """Let ProcessorMixin accept ``video_processor=None`` inside the block; restore it after."""
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return original(self, argument_name, argument)

    ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original  # type: ignore[method-assign]


def write_edit_processor(directory: Path | str) -> Path:
    """Write a processor folder (preprocessor_config.json + Qwen2 tokenizer files); return it."""
    directory = Path(directory)
    save_qwen2_tokenizer(directory)
    config = json.dumps(_IMAGE_PROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n"
    (directory / "preprocessor_config.json").write_text(config, encoding="utf-8")
    return directory


def load_edit_processor(directory: Path | str) -> Any:
    """Build the Qwen2VLProcessor of a processor folder (e.g. ``<pipeline>/processor``) offline."""
    from transformers import AutoImageProcessor, Qwen2Tokenizer, Qwen2VLProcessor

    directory = Path(directory)
    # Without torchvision AutoImageProcessor resolves to the PIL backend of the same processor.
    image_processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    tokenizer = Qwen2Tokenizer.from_pretrained(directory, local_files_only=True)
    with video_processor_optional():
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
