"""The architecture registry: pipeline class -> trained transformer class and its components.

One place to add an architecture. Detection reads `_class_name` and never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.errors import BaseModelError
from mergeflow.jsonfiles import read_json_strict


@dataclass(frozen=True)
class Architecture:
    """What a pipeline class is made of and which component training replaces."""

    name: str
    pipeline_class: str
    transformer_class: str
    components: tuple[str, ...]
    optional_components: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    notes: dict[str, str] = field(default_factory=dict)


_ARCHITECTURES = (
    Architecture("qwenimage", "QwenImagePipeline", "QwenImageTransformer2DModel",
                 ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")),
    Architecture("qwenimage-edit", "QwenImageEditPipeline", "QwenImageTransformer2DModel",
                 ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "processor")),
    Architecture("qwenimage-edit-plus", "QwenImageEditPlusPipeline", "QwenImageTransformer2DModel",
                 ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "processor")),
    Architecture("sd3", "StableDiffusion3Pipeline", "SD3Transformer2DModel",
                 ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3",
                  "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"),
                 optional_components=("image_encoder", "feature_extractor")),
    Architecture("flux", "FluxPipeline", "FluxTransformer2DModel",
                 ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
                 optional_components=("image_encoder", "feature_extractor")),
    Architecture("wan", "WanPipeline", "WanTransformer3DModel",
                 ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
                 optional_components=("transformer_2",), options=("boundary_ratio", "expand_timesteps")),
    Architecture("ltx2", "LTX2Pipeline", "LTX2VideoTransformer3DModel",
                 ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "vocoder", "scheduler")),
    Architecture("boogu", "BooguImagePipeline", "BooguImageTransformer2DModel",
                 ("transformer", "vae", "scheduler", "mllm", "processor")),
)

PIPELINES: dict[str, Architecture] = {a.pipeline_class: a for a in _ARCHITECTURES}

# Transformer classes whose architecture name is known even without a pipeline around them.
TRANSFORMER_ARCH: dict[str, str] = {a.transformer_class: a.name for a in _ARCHITECTURES}
TRANSFORMER_ARCH["MiniMaxH3Transformer3DModel"] = "minimax-h3"


@dataclass(frozen=True)
class BaseLayout:
    """What --base_model points at."""

    kind: str  # "pipeline" | "transformer"
    class_name: str  # pipeline class for pipelines, transformer class otherwise
    architecture: str
    transformer_dir: Path  # the directory holding the transformer config and weights


def detect_base(base_dir: Path, component: str = "transformer") -> BaseLayout:
    """Pipeline if model_index.json exists (its _class_name decides), else a standalone transformer."""
    if not base_dir.is_dir():
        raise BaseModelError(f"--base_model {base_dir} is not a local directory")
    index = base_dir / "model_index.json"
    if index.is_file():
        data = read_json_strict(index, BaseModelError, "model_index.json of the base")
        name = data.get("_class_name") if isinstance(data, dict) else None
        if not isinstance(name, str):
            raise BaseModelError("model_index.json of the base has no _class_name")
        arch = PIPELINES.get(name)
        if arch is None:
            known = ", ".join(sorted(PIPELINES))
            raise BaseModelError(f"unknown pipeline class {name!r} in model_index.json; supported: {known}")
        if component not in data:
            raise BaseModelError(f"the base pipeline {name} declares no component {component!r}")
        comp_dir = base_dir / component
        if comp_dir.is_symlink():
            raise BaseModelError(f"component directory {component}/ of the base is a symlink; copy it in place")
        return BaseLayout("pipeline", name, arch.name, comp_dir)
    config = read_json_strict(base_dir / "config.json", BaseModelError, "config.json of the base transformer")
    name = config.get("_class_name") if isinstance(config, dict) else None
    if not isinstance(name, str):
        raise BaseModelError("config.json of the base has no _class_name; is --base_model a Diffusers model directory?")
    return BaseLayout("transformer", name, TRANSFORMER_ARCH.get(name, name), base_dir)
