"""The runtime check: load an artifact the way its users will, run one denoising step, check the output.

Validation proves bytes, shapes and configs; this proves the artifact runs. It loads with Diffusers
(DiffusionPipeline for a pipeline, the transformer class for a transformer, `from_single_file` for a
single file, PEFT / `load_lora_weights` onto the base for an adapter), runs ONE step at the smallest
latent (2x2 patches, one frame for video) with fixed seeds and a one-word prompt, and checks that the
denoiser's output is finite and has the shape of the latent it was given. The record (device, dtype,
seconds, peak memory, output statistics) is the manifest's `runtime`.

Encoded single files are loaded as what they decode to: GGUF dequantized with gguf's own
`dequantize`, ComfyUI's scaled FP8 as weight * scale (Diffusers' GGUF loader needs a CUDA-less path
it does not offer for every class; a dequantized model proves the same file decodes and runs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mergeflow.errors import ArtifactInvalidError, MergeflowError, UsageError, one_line
from mergeflow.formats.manifest import MANIFEST_NAME
from mergeflow.lora.artifact import adapter_only_root

DTYPES = ("float32", "bfloat16", "float16")
PROMPT = "a cat"  # a tiny prompt: the step's cost is the denoiser's, not the text encoder's
SEED = 0


class RuntimeCheckError(MergeflowError):
    """The artifact did not load or run, or its output was not finite or not the expected shape."""


def check_device(device: str) -> None:
    """Refuse (one line) a device this machine does not have."""
    import torch

    if device == "cpu":
        return
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available on this machine; use --device cpu")
        return
    raise UsageError(f"--device must be cpu or cuda, not {device!r}")


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    return getattr(torch, name)


def _stats(out: Any, expected: tuple[int, ...]) -> dict[str, Any]:
    values = out.detach().float()
    finite = bool(values.isfinite().all())
    shape = tuple(values.shape)
    if not finite:
        raise RuntimeCheckError(f"the runtime check's output is not finite ({int((~values.isfinite()).sum())} values)")
    if shape != expected:
        raise RuntimeCheckError(f"the runtime check's output has shape {list(shape)}, expected {list(expected)}")
    return {"shape": list(shape), "expected_shape": list(expected), "finite": finite,
            "mean": round(float(values.mean()), 6), "std": round(float(values.std()), 6),
            "min": round(float(values.min()), 6), "max": round(float(values.max()), 6)}


def _expected(hidden: Any, config: Mapping[str, Any]) -> tuple[int, ...]:
    """The denoiser predicts the latent it was given: the input's shape, with the declared output channels
    where the latent is channel-first (a Wan image-to-video model takes 36 channels and predicts 16)."""
    shape = list(hidden.shape)
    out_channels = config.get("out_channels")
    if len(shape) in (4, 5) and isinstance(out_channels, int):
        shape[1] = out_channels
    elif len(shape) == 3 and isinstance(out_channels, int):  # packed patches: each holds patch x patch latents
        patch = config.get("patch_size")
        shape[2] = out_channels * (patch * patch if isinstance(patch, int) else 1)
    return tuple(shape)


def _first_tensor(outputs: Any) -> Any:
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        outputs = list(outputs.values())
    for item in outputs:
        if isinstance(item, torch.Tensor):
            return item
    raise RuntimeCheckError("the denoiser returned no tensor")


def transformer_step(model: Any, device: str, dtype: Any) -> dict[str, Any]:
    """One denoiser call on the smallest fixed inputs (mergeflow.demo's tiny inputs, seeded)."""
    import torch

    from mergeflow.demo.tiny_transformers import tiny_forward_inputs

    config = dict(model.config)
    name = type(model).__name__
    inputs = tiny_forward_inputs(name, config, seed=SEED)
    if name == "FluxTransformer2DModel" and not config.get("guidance_embeds"):
        inputs.pop("guidance")
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}
    with torch.no_grad():
        out = _first_tensor(model(**inputs, return_dict=False))
    return _stats(out, _expected(inputs["hidden_states"], config))


def pipeline_step(pipe: Any, device: str) -> dict[str, Any]:
    """One step of the pipeline itself (prompt encoding included), the denoiser's output checked through a hook."""
    import torch

    seen: dict[str, Any] = {}

    def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen.setdefault("hidden", hidden)
        seen.setdefault("out", _first_tensor(output))

    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not None and getattr(scheduler.config, "shift_terminal", None):
        # A one-step schedule stretched to a terminal shift is 0/0 in Diffusers (stretch_shift_to_terminal
        # divides by the last sigma's distance from 1, which is 0 for one step): the step runs unstretched.
        pipe.scheduler = type(scheduler).from_config({**scheduler.config, "shift_terminal": None})
    transformer = pipe.transformer
    handle = transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        size = _smallest_size(pipe)
        kwargs: dict[str, Any] = {"prompt": PROMPT, "num_inference_steps": 1, "height": size, "width": size,
                                  "generator": torch.Generator(device="cpu").manual_seed(SEED), "output_type": "latent"}
        parameters = _call_parameters(pipe)
        if "num_frames" in parameters:
            kwargs["num_frames"] = 1
        if "image" in parameters:  # an editing pipeline (Qwen-Image-Edit): its input image, seeded and tiny
            kwargs["image"] = _input_image(size)
        with torch.no_grad():
            pipe(**kwargs)
    finally:
        handle.remove()
    if "out" not in seen:
        raise RuntimeCheckError("the pipeline ran no denoising step")
    return _stats(seen["out"], _expected(seen["hidden"], dict(transformer.config)))


def _input_image(size: int) -> Any:
    """A seeded RGB noise image of size x size pixels, the input an editing pipeline needs for its one step."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(SEED).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def _call_parameters(pipe: Any) -> set[str]:
    import inspect

    return set(inspect.signature(type(pipe).__call__).parameters)


def _smallest_size(pipe: Any) -> int:
    """The smallest height/width the pipeline accepts: one 2x2 patch of latents."""
    scale = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None) or 8
    return int(scale) * 2 * 2


@contextmanager
def _measured(device: str) -> Iterator[dict[str, Any]]:
    import torch

    record: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    yield record
    record["seconds"] = round(time.perf_counter() - started, 3)
    if device == "cuda":
        record["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    else:
        import resource

        record["peak_memory_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactInvalidError(f"{root.name} has no {MANIFEST_NAME}; is it a mergeflow artifact?")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ArtifactInvalidError(f"{MANIFEST_NAME} is not a JSON object")
    return data


def run_runtime_check(artifact: Path, *, device: str = "cpu", dtype: str = "float32", base: Path | None = None,
                      trust_remote_code: bool = False, components: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load `artifact` with Diffusers and run one denoising step; its `runtime` record (raises on a failure).

    `base`: the base pipeline or transformer folder an adapter is loaded onto.
    `components`: objects a pipeline is loaded with in place of its own folders, as `from_pretrained` takes them
    (Python API only): e.g. a Qwen-Image-Edit processor built without its video processor, which needs
    torchvision, on a machine without it.
    """
    check_device(device)
    torch_dtype = _torch_dtype(dtype)
    root = adapter_only_root(artifact) or artifact
    manifest = _read_manifest(root)
    kind = manifest.get("artifact_type")
    with _measured(device) as measured:
        try:
            from mergeflow.outputs.smoke_loaders import load_and_step

            loaded_as, step, output = load_and_step(root, manifest, device, torch_dtype, base, trust_remote_code,
                                                    components)
        except MergeflowError:
            raise
        except Exception as exc:  # a loader or model failure is the check's result, in one line
            raise RuntimeCheckError(f"the runtime check failed loading or running the {kind}: "
                                    f"{type(exc).__name__}: {one_line(str(exc))}") from exc
    return {"status": "passed", "artifact_type": kind, "loaded_as": loaded_as, "step": step, "device": device,
            "dtype": dtype, "seed": SEED, **measured, "output": output}


def runtime_markdown(record: Mapping[str, Any]) -> str:
    """The runtime check's result as a small markdown table (the Prefect artifact of a smoke run)."""
    output = record.get("output", {})
    rows = [("result", record.get("status")), ("loaded as", record.get("loaded_as")), ("step", record.get("step")),
            ("device", record.get("device")), ("dtype", record.get("dtype")), ("seconds", record.get("seconds")),
            ("peak memory (bytes)", record.get("peak_memory_bytes")), ("output shape", output.get("shape")),
            ("output mean / std", f"{output.get('mean')} / {output.get('std')}"),
            ("output min / max", f"{output.get('min')} / {output.get('max')}")]
    return "| runtime check | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
