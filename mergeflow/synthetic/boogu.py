"""Tiny, offline Boogu-Image base pipelines in the remote-code layout of the release.

Boogu-Image is not in Diffusers (its package ``boogu`` is not installed here), so its base
ships code: ``transformer/transformer_boogu.py`` (``BooguImageTransformer2DModel``) and
``scheduler/scheduling_flow_match_euler_discrete_time_shifting.py`` (Boogu's own
``FlowMatchEulerDiscreteScheduler``), named in ``model_index.json`` as ``[module, class]`` custom
components, plus a root ``pipeline.py`` for Diffusers' ``custom_pipeline`` loading. The VAE is
a FLUX-style ``AutoencoderKL``, the MLLM a ``Qwen3VLForConditionalGeneration`` and the processor a
hand-written ``Qwen3VLProcessor`` folder. Loading any of the code needs ``trust_remote_code``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mergeflow.synthetic.components import autoencoder_kl, seeded, write_extras
from mergeflow.synthetic.qwen3vl import load_qwen3vl_processor, qwen3vl_model, write_qwen3vl_processor

PIPELINE_CLASS = "BooguImagePipeline"
TRANSFORMER_MODULE = "transformer_boogu"
TRANSFORMER_CLASS = "BooguImageTransformer2DModel"
SCHEDULER_MODULE = "scheduling_flow_match_euler_discrete_time_shifting"
SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
_SOURCES: dict[str, str] = {
    f"transformer/{TRANSFORMER_MODULE}.py": "boogu_transformer_remote.py",
    f"scheduler/{SCHEDULER_MODULE}.py": "boogu_scheduler_remote.py",
    "pipeline.py": "boogu_pipeline_remote.py",
}
# Head size 8 = sum(axes_dim_rope); 3 query heads share 1 key/value head (GQA, as upstream).
BOOGU_TINY_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": None,
    "hidden_size": 24,
    "num_layers": 2,
    "num_double_stream_layers": 1,
    "num_refiner_layers": 1,
    "num_attention_heads": 3,
    "num_kv_heads": 1,
    "multiple_of": 8,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "axes_dim_rope": (2, 2, 4),
    "axes_lens": (64, 64, 64),
    "instruction_feature_configs": {
        "instruction_feat_dim": 12,
        "num_instruction_feat_layers": 1,
        "reduce_type": "mean",
    },
    "timestep_scale": 1000.0,
}
_SCHEDULER_CONFIG: dict[str, Any] = {"do_shift": True, "dynamic_time_shift": False, "seq_len": 4096}
_RELEASE_DIFFUSERS_VERSION = "0.35.2"  # what the release's model_index.json carries


def remote_class(component_dir: Path, module: str, class_name: str) -> type:
    """Import ``class_name`` from ``<component_dir>/<module>.py`` the way Diffusers loads custom components."""
    from diffusers.utils.dynamic_modules_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(
        str(component_dir), module_file=f"{module}.py", class_name=class_name, trust_remote_code=True
    )


def _declared(root: Path, component: str) -> tuple[str, str]:
    """The ``[module, class]`` that ``model_index.json`` declares for ``component``."""
    index = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
    module, class_name = index[component]
    return module, class_name


def load_boogu_transformer(root: Path | str) -> Any:
    """Load a Boogu base's transformer through Diffusers' remote-code loading (trust_remote_code)."""
    root = Path(root)
    cls = remote_class(root / "transformer", *_declared(root, "transformer"))
    return cls.from_pretrained(root, subfolder="transformer", local_files_only=True).eval()


def boogu_transformer_instance(root: Path | str, *, seed: int = 1) -> Any:
    """A fresh, seeded transformer of the base's remote class and config (e.g. a training actor)."""
    root = Path(root)
    cls = remote_class(root / "transformer", *_declared(root, "transformer"))
    config = cls.load_config(root / "transformer", local_files_only=True)
    with seeded(seed):
        return cls.from_config(config).eval()


def load_boogu_pipeline(root: Path | str) -> Any:
    """Load the whole Boogu base with Diffusers (custom pipeline; the processor is built offline and passed in)."""
    from diffusers import DiffusionPipeline

    root = Path(root)
    return DiffusionPipeline.from_pretrained(
        root,
        custom_pipeline=str(root),
        trust_remote_code=True,
        local_files_only=True,
        processor=load_qwen3vl_processor(root / "processor"),
    )


def build_boogu_pipeline(root: Path | str, *, seed: int = 0) -> Path:
    """Write a tiny Boogu-Image base (remote-code layout) with a seeded transformer; return its root."""
    from transformers import Qwen2Tokenizer

    root = Path(root)
    for target, source in _SOURCES.items():
        path = root / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Path(__file__).with_name(source).read_text(encoding="utf-8"), encoding="utf-8")
    transformer_cls = remote_class(root / "transformer", TRANSFORMER_MODULE, TRANSFORMER_CLASS)
    with seeded(seed):
        transformer = transformer_cls(**BOOGU_TINY_CONFIG).eval()
    transformer.save_pretrained(root / "transformer")
    scheduler_cls = remote_class(root / "scheduler", SCHEDULER_MODULE, SCHEDULER_CLASS)
    scheduler_cls(**_SCHEDULER_CONFIG).save_pretrained(root / "scheduler")
    # FLUX-style VAE: its latent channels are what the transformer denoises.
    vae = autoencoder_kl(BOOGU_TINY_CONFIG["in_channels"], scaling_factor=0.3611, shift_factor=0.1159)
    vae.save_pretrained(root / "vae")
    processor_dir = write_qwen3vl_processor(root / "processor")
    tokenizer = Qwen2Tokenizer.from_pretrained(processor_dir, local_files_only=True)
    feat = BOOGU_TINY_CONFIG["instruction_feature_configs"]["instruction_feat_dim"]
    qwen3vl_model(feat, tokenizer).save_pretrained(root / "mllm")
    index = {
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": _RELEASE_DIFFUSERS_VERSION,
        "mllm": ["transformers", "Qwen3VLForConditionalGeneration"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": [SCHEDULER_MODULE, SCHEDULER_CLASS],
        "transformer": [TRANSFORMER_MODULE, TRANSFORMER_CLASS],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_extras(root, PIPELINE_CLASS)
    return root
