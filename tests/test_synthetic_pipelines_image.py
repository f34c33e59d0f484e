"""Tiny offline base pipelines (Qwen-Image, SD3, Flux) and tokenizers load and run as the real thing."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # must precede the first huggingface_hub import

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures.pipelines_image import (
    build_flux_pipeline,
    build_qwenimage_pipeline,
    build_sd3_pipeline,
    tiny_flux_transformer,
    tiny_qwenimage_transformer,
    tiny_sd3_transformer,
)
from fixtures.qwen_processor import load_edit_processor
from fixtures.tokenizers import (
    save_clip_tokenizer,
    save_gemma_tokenizer,
    save_qwen2_tokenizer,
    save_t5_tokenizer,
)
from PIL import Image

from mergeflow.errors import UsageError

PROMPT = "A photo of a cat, 4K: high quality!"

# name -> (writer, tokenizer class name, files that must exist)
TOKENIZERS: dict[str, tuple[Callable[[Path], Path], str, set[str]]] = {
    "clip": (save_clip_tokenizer, "CLIPTokenizer", {"tokenizer.json", "vocab.json", "merges.txt"}),
    "t5": (save_t5_tokenizer, "T5Tokenizer", {"tokenizer.json", "spiece.model"}),
    "qwen2": (save_qwen2_tokenizer, "Qwen2Tokenizer", {"tokenizer.json", "vocab.json", "merges.txt"}),
    "gemma": (save_gemma_tokenizer, "GemmaTokenizer", {"tokenizer.json", "tokenizer.model"}),
}

# Builders of the pipelines under test: name -> (build(root), pipeline class name).
PIPELINES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "qwenimage": (lambda root: build_qwenimage_pipeline(root, tiny_qwenimage_transformer()), "QwenImagePipeline"),
    "qwenimage_edit": (
        lambda root: build_qwenimage_pipeline(root, tiny_qwenimage_transformer(), variant="edit"),
        "QwenImageEditPipeline",
    ),
    "qwenimage_edit_plus": (
        lambda root: build_qwenimage_pipeline(root, tiny_qwenimage_transformer(), variant="edit_plus"),
        "QwenImageEditPlusPipeline",
    ),
    "sd3": (lambda root: build_sd3_pipeline(root, tiny_sd3_transformer()), "StableDiffusion3Pipeline"),
    "flux": (lambda root: build_flux_pipeline(root, tiny_flux_transformer()), "FluxPipeline"),
}
EDIT_VARIANTS = {"qwenimage_edit", "qwenimage_edit_plus"}
TOKENIZER_VOCAB_FILES = {"tokenizer.json", "vocab.json", "spiece.model", "tokenizer.model"}


def _load(root: Path, name: str) -> Any:
    """Load a built pipeline offline, passing the hand-built processor for Edit variants."""
    from diffusers import DiffusionPipeline

    extra = {"processor": load_edit_processor(root / "processor")} if name in EDIT_VARIANTS else {}
    return DiffusionPipeline.from_pretrained(root, local_files_only=True, **extra)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every pipeline of PIPELINES, built once for the module."""
    base = tmp_path_factory.mktemp("pipelines")
    return {name: build(base / name) for name, (build, _) in PIPELINES.items()}


@pytest.fixture(scope="module")
def loaded(built: dict[str, Path]) -> dict[str, Any]:
    """Every built pipeline, loaded once with DiffusionPipeline.from_pretrained."""
    return {name: _load(root, name) for name, root in built.items()}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_tokenizer_folder_loads_offline_and_tokenises(tmp_path: Path, name: str) -> None:
    from transformers import AutoTokenizer

    write, class_name, required = TOKENIZERS[name]
    folder = write(tmp_path / name)
    assert folder == tmp_path / name
    assert required | {"tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(tokenizer).__name__ == class_name
    ids = tokenizer(PROMPT)["input_ids"]
    content = [i for i in ids if i not in tokenizer.all_special_ids]
    assert content, ids
    # Every printable ASCII character is in the training corpus: no <unk> in an ASCII prompt.
    assert tokenizer.unk_token_id not in content
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded.replace(" ", "").lower() == PROMPT.replace(" ", "").lower()
    # save_pretrained records absolute paths; the folder must not carry any of this machine's.
    config_text = (folder / "tokenizer_config.json").read_text(encoding="utf-8")
    assert str(tmp_path) not in config_text and "name_or_path" not in config_text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_tokenizer_folder_is_deterministic(tmp_path: Path, name: str) -> None:
    write = TOKENIZERS[name][0]
    first, second = write(tmp_path / "a"), write(tmp_path / "b")
    digests = [
        {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} for folder in (first, second)
    ]
    assert digests[0] == digests[1]


def test_qwen2_tokenizer_has_single_token_vision_markers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_qwen2_tokenizer(tmp_path / "tok"))
    for marker in ("<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_end|>"):
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        assert ids == [tokenizer.convert_tokens_to_ids(marker)], marker


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_loads_as_its_own_class(loaded: dict[str, Any], name: str) -> None:
    pipe = loaded[name]
    assert type(pipe).__name__ == PIPELINES[name][1]
    assert pipe.transformer is not None and pipe.vae is not None and pipe.scheduler is not None


def _declared_components(root: Path) -> dict[str, tuple[str, str]]:
    """Components of model_index.json that are present (library, class), skipping [null, null]."""
    index = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
    return {
        key: (value[0], value[1])
        for key, value in index.items()
        if not key.startswith("_") and isinstance(value, list) and value[0] is not None
    }


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_declared_component_is_complete(built: dict[str, Path], name: str) -> None:
    root = built[name]
    index = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
    assert index["_class_name"] == PIPELINES[name][1]
    components = _declared_components(root)
    assert "transformer" in components
    assert ("processor" in components) == (name in EDIT_VARIANTS)
    for component, (library, class_name) in components.items():
        folder = root / component
        files = {p.name for p in folder.iterdir()}
        if component == "scheduler":
            config = json.loads((folder / "scheduler_config.json").read_text(encoding="utf-8"))
            assert config["_class_name"] == class_name
        elif component.startswith("tokenizer"):
            assert files & TOKENIZER_VOCAB_FILES, (component, files)
            assert "tokenizer_config.json" in files
        elif component == "processor":
            assert {"preprocessor_config.json", "tokenizer.json", "vocab.json", "merges.txt"} <= files
        elif library == "diffusers":
            assert {"config.json", "diffusion_pytorch_model.safetensors"} <= files, (component, files)
        else:
            assert library == "transformers"
            assert {"config.json", "model.safetensors"} <= files, (component, files)
    assert (root / "LICENSE").read_text(encoding="utf-8").strip()
    assert (root / "README.md").read_text(encoding="utf-8").startswith("# ")


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_no_local_path_in_written_text_files(built: dict[str, Path], name: str) -> None:
    root = built[name]
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in {".json", ".txt", ".md"}:
            text = path.read_text(encoding="utf-8")
            assert str(root.parent) not in text and "/tmp" not in text, path


def _forward_inputs(pipe: Any) -> dict[str, Any]:
    """Inputs for one forward of the pipeline's transformer at a 2x2 latent grid (batch 1)."""
    config = pipe.transformer.config
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(1, 3, config.joint_attention_dim, generator=gen)
    name = type(pipe.transformer).__name__
    if name == "SD3Transformer2DModel":
        side = 2 * config.patch_size
        return {
            "hidden_states": torch.randn(1, config.in_channels, side, side, generator=gen),
            "encoder_hidden_states": text,
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=gen),
            "timestep": torch.tensor([500.0]),
        }
    latents = torch.randn(1, 4, config.in_channels, generator=gen)
    if name == "FluxTransformer2DModel":
        grid = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(2.0), indexing="ij"), -1).reshape(4, 2)
        return {
            "hidden_states": latents,
            "encoder_hidden_states": text,
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=gen),
            "timestep": torch.tensor([0.5]),
            "img_ids": torch.cat([torch.zeros(4, 1), grid], dim=1),
            "txt_ids": torch.zeros(3, 3),
            "guidance": torch.tensor([3.5]) if config.guidance_embeds else None,
        }
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text,
        "encoder_hidden_states_mask": torch.ones(1, 3, dtype=torch.long),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 2, 2)]],
    }


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_loaded_transformer_runs_a_forward(loaded: dict[str, Any], name: str) -> None:
    pipe = loaded[name]
    inputs = _forward_inputs(pipe)
    with torch.no_grad():
        sample = pipe.transformer(**inputs, return_dict=False)[0]
    assert sample.shape[0] == 1 and torch.isfinite(sample).all()
    if name.startswith("sd3"):
        assert sample.shape[1] == pipe.transformer.config.out_channels
    else:
        assert sample.shape[1] == 4


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_saved_transformer_weights_are_the_given_ones(loaded: dict[str, Any], name: str) -> None:
    tiny = tiny_sd3_transformer if name == "sd3" else tiny_flux_transformer if name == "flux" else tiny_qwenimage_transformer
    expected = tiny().state_dict()
    actual = loaded[name].transformer.state_dict()
    assert expected.keys() == actual.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


@pytest.mark.parametrize("name", ["qwenimage", "sd3", "flux"])
def test_two_step_text_to_image_call(loaded: dict[str, Any], name: str) -> None:
    pipe = loaded[name]
    # Qwen-Image guides with true_cfg_scale (off without a negative prompt); the others take 1.0.
    extra = {} if name == "qwenimage" else {"guidance_scale": 1.0}
    # Two steps: Qwen-Image's released scheduler (shift_terminal) divides by zero for one step.
    out = pipe(
        PROMPT, num_inference_steps=2, height=32, width=32, output_type="np",
        generator=torch.Generator().manual_seed(0), **extra,
    )
    assert out.images.shape == (1, 32, 32, 3)
    assert np.isfinite(out.images).all()


@pytest.mark.parametrize("name", sorted(EDIT_VARIANTS))
def test_edit_prompt_encoding_reads_the_image(loaded: dict[str, Any], name: str) -> None:
    # A full Edit call resizes the condition image to ~1024x1024 for the VAE (seconds on CPU),
    # so this exercises processor + vision tower + text tower through encode_prompt instead.
    pipe = loaded[name]
    image = Image.fromarray((np.random.RandomState(0).rand(48, 64, 3) * 255).astype(np.uint8))
    image_arg: Any = image if name == "qwenimage_edit" else [image]
    embeds, _ = pipe.encode_prompt(PROMPT, image=image_arg)
    with_blank, _ = pipe.encode_prompt(PROMPT, image=_blank(image_arg))
    assert embeds.shape[-1] == pipe.transformer.config.joint_attention_dim
    assert torch.isfinite(embeds).all()
    # Image tokens take part: a different image changes the embeddings.
    assert not torch.equal(embeds, with_blank)


def _blank(image_arg: Any) -> Any:
    """The same image argument with black pixels instead of noise."""
    blank = Image.new("RGB", (64, 48))
    return [blank] if isinstance(image_arg, list) else blank


def test_processor_class_check_is_restored(built: dict[str, Path]) -> None:
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class
    processor = load_edit_processor(built["qwenimage_edit"] / "processor")
    assert ProcessorMixin.check_argument_for_proper_class is original
    assert processor.image_processor.merge_size == 2
    # Outside the block the library refuses a missing video processor again (the exact error
    # depends on whether torchvision's video mapping can be imported).
    with pytest.raises((TypeError, AttributeError)):
        Qwen2VLProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer, video_processor=None)


def test_builds_are_deterministic(tmp_path: Path, built: dict[str, Path]) -> None:
    again = build_flux_pipeline(tmp_path / "flux", tiny_flux_transformer())
    for path in sorted(built["flux"].rglob("*")):
        if path.is_file():
            twin = again / path.relative_to(built["flux"])
            assert twin.read_bytes() == path.read_bytes(), path


def test_unknown_qwenimage_variant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="variant"):
        build_qwenimage_pipeline(tmp_path / "x", tiny_qwenimage_transformer(), variant="layered")
    assert not (tmp_path / "x").exists()


# Other shapes than the tiny_* helpers: every builder must size its components from the config.
# Lists, not tuples, because the loaded config comes from JSON.
OTHER_CONFIGS: dict[str, tuple[str, dict[str, Any], Callable[[Path, Any], Path]]] = {
    "qwenimage": (
        "QwenImageTransformer2DModel",
        {"patch_size": 2, "in_channels": 8, "out_channels": 2, "num_layers": 1, "attention_head_dim": 12,
         "num_attention_heads": 1, "joint_attention_dim": 24, "axes_dims_rope": [4, 4, 4]},
        build_qwenimage_pipeline,
    ),
    "sd3": (
        "SD3Transformer2DModel",
        {"sample_size": 8, "patch_size": 1, "in_channels": 6, "out_channels": 6, "num_layers": 2,
         "attention_head_dim": 8, "num_attention_heads": 3, "joint_attention_dim": 20, "caption_projection_dim": 24,
         "pooled_projection_dim": 14, "pos_embed_max_size": 8, "dual_attention_layers": [0], "qk_norm": "rms_norm"},
        build_sd3_pipeline,
    ),
    "flux": (
        "FluxTransformer2DModel",
        {"patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 8,
         "num_attention_heads": 3, "joint_attention_dim": 20, "pooled_projection_dim": 12, "guidance_embeds": False,
         "axes_dims_rope": [2, 2, 4]},
        build_flux_pipeline,
    ),
}


def _transformer(class_name: str, config: dict[str, Any]) -> Any:
    import diffusers

    torch.manual_seed(1)
    return getattr(diffusers, class_name)(**config).eval()


@pytest.mark.parametrize("name", sorted(OTHER_CONFIGS))
def test_builder_sizes_components_from_the_transformer_config(tmp_path: Path, name: str) -> None:
    class_name, config, build = OTHER_CONFIGS[name]
    pipe = _load(build(tmp_path / name, _transformer(class_name, config)), name)
    assert dict(pipe.transformer.config) == {**dict(pipe.transformer.config), **config}
    extra = {} if name == "qwenimage" else {"guidance_scale": 1.0}
    out = pipe("a cat", num_inference_steps=2, height=16, width=16, output_type="np", **extra)
    assert out.images.shape == (1, 16, 16, 3) and np.isfinite(out.images).all()


@pytest.mark.parametrize("name", sorted(OTHER_CONFIGS))
def test_builder_accepts_widths_that_cannot_run_a_pipeline(tmp_path: Path, name: str) -> None:
    # Merge fixtures use odd widths (5 latent channels, 7-wide text) to shard unevenly; such a
    # base cannot generate images but must still build and load completely.
    class_name, config, build = OTHER_CONFIGS[name]
    odd = {**config, "in_channels": 5, "joint_attention_dim": 7}
    if name != "qwenimage":
        odd["pooled_projection_dim"] = 5
    if name == "sd3":
        odd["out_channels"] = 3
    pipe = _load(build(tmp_path / name, _transformer(class_name, odd)), name)
    assert pipe.transformer.config.joint_attention_dim == 7
    assert not any(p.is_meta for p in pipe.components["text_encoder"].parameters())
