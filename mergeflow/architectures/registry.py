"""The architecture registry: pipeline class -> trained transformer class and its components.

One place to add an architecture. Detection reads `_class_name` and never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.architectures.adapters import DIFFUSERS, REMOTE_CODE, ArchitectureAdapter
from mergeflow.architectures.minimax_h3 import MINIMAX_H3_NATIVE
from mergeflow.architectures.original_layout import ORIGINAL_LAYOUT
from mergeflow.errors import BaseModelError
from mergeflow.formats.model_config import PipelineIndex
from mergeflow.io.jsonfiles import read_json_strict

MODEL, SCHEDULER, TOKENIZER, PROCESSOR = "model", "scheduler", "tokenizer", "processor"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
TRANSFORMERS_WEIGHTS = "model.safetensors"
# Libraries a component may name in the index besides a remote-code module of the base itself.
# `ltx2` is diffusers.pipelines.ltx2: Diffusers models, saved with Diffusers' weight naming.
KNOWN_LIBRARIES = ("diffusers", "transformers", "ltx2")
INDEX_FILES = ("model_index.json", "modular_model_index.json")


@dataclass(frozen=True)
class ComponentSpec:
    """What a component folder must hold: its kind, and a fixed library or weight name if any."""

    kind: str  # model | scheduler | tokenizer | processor
    library: str | None = None  # the library the index must name (LTX-2's connectors: "ltx2")
    weights_name: str | None = None  # when not the library's default naming


def _kind(name: str) -> str:
    if "scheduler" in name:
        return SCHEDULER
    if name.startswith("tokenizer"):
        return TOKENIZER
    if name in ("processor", "feature_extractor", "image_processor"):
        return PROCESSOR
    return MODEL


def _components(*names: str, **special: ComponentSpec) -> dict[str, ComponentSpec]:
    """Component specs by name, the kind inferred from the name unless given explicitly."""
    specs = {name: ComponentSpec(_kind(name)) for name in names}
    specs.update(special)
    return specs


@dataclass(frozen=True)
class Architecture:
    """What a pipeline class is made of, which component training replaces, and how it is written."""

    name: str
    pipeline_class: str
    transformer_class: str  # the class training uses (the checkpoint's _class_name)
    components: dict[str, ComponentSpec]
    optional_components: dict[str, ComponentSpec] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    index_file: str = "model_index.json"
    artifact_type: str = "diffusers_pipeline"
    trainable: tuple[str, ...] = ("transformer",)  # components a checkpoint may replace (--component)
    trained_class: str | None = None  # class the index declares for the trained component, if not transformer_class
    adapter: ArchitectureAdapter = DIFFUSERS  # how the trained schema is checked and tensors converted
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def declared_class(self) -> str:
        return self.trained_class or self.transformer_class

    def spec(self, component: str) -> ComponentSpec | None:
        """The spec of a known component, None for a component this architecture does not have."""
        return self.components.get(component) or self.optional_components.get(component)


_QWEN = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
_ARCHITECTURES = (
    Architecture("qwenimage", "QwenImagePipeline", "QwenImageTransformer2DModel", _components(*_QWEN)),
    Architecture("qwenimage-edit", "QwenImageEditPipeline", "QwenImageTransformer2DModel",
                 _components(*_QWEN, "processor")),
    Architecture("qwenimage-edit-plus", "QwenImageEditPlusPipeline", "QwenImageTransformer2DModel",
                 _components(*_QWEN, "processor")),
    Architecture("sd3", "StableDiffusion3Pipeline", "SD3Transformer2DModel",
                 _components("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3",
                             "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"),
                 optional_components=_components("image_encoder", "feature_extractor")),
    Architecture("flux", "FluxPipeline", "FluxTransformer2DModel",
                 _components("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                             "scheduler"),
                 optional_components=_components("image_encoder", "feature_extractor")),
    Architecture("wan", "WanPipeline", "WanTransformer3DModel",
                 _components("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
                 optional_components=_components("transformer_2"), options=("boundary_ratio", "expand_timesteps"),
                 trainable=("transformer", "transformer_2"),
                 notes={"transformer_2": "Wan2.2's low-noise expert; copied unless --component transformer_2"}),
    Architecture("ltx2", "LTX2Pipeline", "LTX2VideoTransformer3DModel",
                 _components("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "scheduler",
                             connectors=ComponentSpec(MODEL, library="ltx2"),
                             vocoder=ComponentSpec(MODEL, library="ltx2")),
                 optional_components=_components("processor", "prompt_enhancer", "duration_head")),
    Architecture("minimax-h3", "MiniMaxH3Pipeline", "MiniMaxH3Transformer3DModel",
                 _components("text_encoder", "video_vae", "audio_vae", "processor", "tokenizer",
                             transformer=ComponentSpec(MODEL, weights_name=TRANSFORMERS_WEIGHTS)),
                 optional_components=_components("scheduler"),
                 artifact_type="minimax_h3_pipeline", trained_class="MiniMaxH3DiTModel", adapter=MINIMAX_H3_NATIVE,
                 notes={"transformer": "native MiniMaxH3DiTModel: names and layouts converted (SPEC section 3)"}),
    Architecture("minimax-h3-modular", "MiniMaxH3ModularPipeline", "MiniMaxH3Transformer3DModel",
                 _components("transformer", "transformer_ref", "vae", "audio_vae", "scheduler", "audio_scheduler",
                             "text_encoder", "tokenizer", "processor"),
                 index_file="modular_model_index.json", trainable=("transformer", "transformer_ref")),
    Architecture("boogu", "BooguImagePipeline", "BooguImageTransformer2DModel",
                 _components("transformer", "vae", "scheduler", "mllm", "processor"), adapter=REMOTE_CODE,
                 notes={"transformer": "remote code (transformer/transformer_boogu.py); needs --trust-remote-code"}),
)

PIPELINES: dict[str, Architecture] = {a.pipeline_class: a for a in _ARCHITECTURES}

# Transformer classes whose architecture name is known even without a pipeline around them.
TRANSFORMER_ARCH: dict[str, str] = {}
for _arch in reversed(_ARCHITECTURES):  # the first architecture of a class names it
    TRANSFORMER_ARCH[_arch.transformer_class] = _arch.name


def weights_name_for(spec: ComponentSpec, library: str | None) -> str:
    """The weight file name a component folder must use: Transformers models `model.safetensors`."""
    if spec.weights_name:
        return spec.weights_name
    return TRANSFORMERS_WEIGHTS if library == "transformers" else DIFFUSERS_WEIGHTS


@dataclass(frozen=True)
class BaseLayout:
    """What --base_model points at."""

    kind: str  # "pipeline" | "transformer"
    class_name: str  # pipeline class for pipelines, transformer class otherwise
    architecture: str
    transformer_dir: Path  # the directory holding the transformer config and weights
    index_file: str | None = None  # model_index.json or modular_model_index.json for pipelines

    @property
    def transformer_class(self) -> str:
        """The transformer class the base holds (a pipeline's own, or the standalone one)."""
        return PIPELINES[self.class_name].transformer_class if self.kind == "pipeline" else self.class_name


def read_index(base_dir: Path) -> tuple[str, PipelineIndex] | None:
    """The pipeline index of a base (model_index.json first, then the modular one), or None."""
    for name in INDEX_FILES:
        path = base_dir / name
        if path.is_file() or path.is_symlink():
            data = read_json_strict(path, BaseModelError, f"{name} of the base")
            if not isinstance(data, dict):
                raise BaseModelError(f"{name} of the base must be a JSON object")
            return name, data
    return None


def architecture_of(class_name: object, index_file: str) -> Architecture:
    """The registered architecture of a pipeline class; unknown names are refused."""
    if not isinstance(class_name, str):
        raise BaseModelError(f"{index_file} of the base has no _class_name")
    arch = PIPELINES.get(class_name)
    if arch is None:
        known = ", ".join(sorted(PIPELINES))
        raise BaseModelError(f"unknown pipeline class {class_name!r} in {index_file}; supported: {known}")
    if arch.index_file != index_file:
        raise BaseModelError(f"{class_name} is described by {arch.index_file}, but the base has {index_file}")
    return arch


def declared_entry(index: PipelineIndex, component: str) -> tuple[str, str] | None:
    """(library, class) the index declares for a component; None when absent or null."""
    value = index.get(component)
    if not isinstance(value, (list, tuple)) or len(value) not in (2, 3):
        return None
    library, class_name = value[0], value[1]
    if library is None and class_name is None:
        return None
    if not isinstance(library, str) or not isinstance(class_name, str):
        raise BaseModelError(f"component {component!r} of the base index must be [library, class], not {value!r}")
    return library, class_name


def detect_base(base_dir: Path, component: str = "transformer") -> BaseLayout:
    """Pipeline if model_index.json (or modular_model_index.json) exists, else a standalone transformer."""
    if not base_dir.is_dir():
        raise BaseModelError(f"--base_model {base_dir} is not a local directory")
    found = read_index(base_dir)
    if found is not None:
        index_file, data = found
        arch = architecture_of(data.get("_class_name"), index_file)
        if declared_entry(data, component) is None:
            raise BaseModelError(f"the base pipeline {arch.pipeline_class} declares no component {component!r}")
        comp_dir = base_dir / component
        if comp_dir.is_symlink():
            raise BaseModelError(f"component directory {component}/ of the base is a symlink; copy it in place")
        return BaseLayout("pipeline", arch.pipeline_class, arch.name, comp_dir, index_file)
    config = read_json_strict(base_dir / "config.json", BaseModelError, "config.json of the base transformer")
    name = config.get("_class_name") if isinstance(config, dict) else None
    if not isinstance(name, str):
        raise BaseModelError("config.json of the base has no _class_name; is --base_model a Diffusers model directory?")
    return BaseLayout("transformer", name, TRANSFORMER_ARCH.get(name, name), base_dir)



def base_layout(base_dir: Path, component: str = "transformer") -> BaseLayout:
    """`detect_base`, run once per export (mergeflow.io.session): the pre-flight, the plan and LoRA ask alike."""
    from mergeflow.io.session import current_session

    return current_session().once("base-layout", f"{base_dir}\0{component}", lambda: detect_base(base_dir, component))

ADAPTERS: dict[str, ArchitectureAdapter] = {a.name: a for a in (DIFFUSERS, REMOTE_CODE, MINIMAX_H3_NATIVE, ORIGINAL_LAYOUT)}


def adapter_of(layout: BaseLayout) -> ArchitectureAdapter:
    """The adapter of a base: its pipeline's, or the one whose own class a standalone transformer is."""
    if layout.kind == "pipeline":
        return PIPELINES[layout.class_name].adapter
    for adapter in ADAPTERS.values():
        if layout.class_name in adapter.native_classes:
            return adapter
    return DIFFUSERS


def adapter_for_op(op: str) -> ArchitectureAdapter:
    """The adapter whose writes use tensor transform `op`."""
    for adapter in ADAPTERS.values():
        if op in adapter.ops:
            return adapter
    return DIFFUSERS  # whose apply_op refuses the unknown op
