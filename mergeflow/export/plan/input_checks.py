"""The input checks the pre-flight and planning share: paths, overlaps, the base's layout and classes, LoRA flags.

Each checkpoint source's `preflight` runs the ones its kind needs (mergeflow.sources); the
pre-flight (preflight.py) runs the source's. They read listings and small JSON files only, and
import neither torch nor diffusers nor any checkpoint source, so the sources can use them.
"""


from __future__ import annotations

import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

from mergeflow.architectures.registry import BaseLayout, base_layout
from mergeflow.config import DEFAULT_ADAPTER_FORMAT, ModelMergerConfig
from mergeflow.errors import (
    BaseModelError,
    CheckpointError,
    SchemaMismatchError,
    UsageError,
)
from mergeflow.formats.dcp_layout import NO_MODEL_CONFIG
from mergeflow.formats.model_config import ModelConfig
from mergeflow.formats.verl_checkpoint import LORA_META, step_of
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.io.paths import check_no_overlap
from mergeflow.io.session import current_session
from mergeflow.io.staging import check_target
from mergeflow.outputs.registry import model_output

CHECKPOINT_CONFIG = "huggingface/config.json of the checkpoint"


def resolve_inputs(config: ModelMergerConfig) -> dict[str, Path]:
    """Absolute input/output paths, checked for existence and overlap (once per export)."""
    return dict(current_session().once("inputs", config_key(config), lambda: _resolve_inputs(config)))


def config_key(config: ModelMergerConfig) -> str:
    """What keys an export's planning in its session: every option as given."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def _resolve_inputs(config: ModelMergerConfig) -> dict[str, Path]:
    actor = Path(config.local_dir or "").expanduser().resolve()
    cfg_dir = Path(config.hf_model_config_path or actor / "huggingface").expanduser().resolve()
    base = local_base(config.base_model)
    target = check_target(Path(config.target_dir or ""))
    require_local_dir(actor)
    check_no_overlap({"--local_dir": actor, "--base_model": base, "--target_dir": target})
    check_no_overlap({"--hf_model_config_path": cfg_dir, "--target_dir": target})
    check_no_overlap({"--hf_model_config_path": cfg_dir, "--base_model": base})
    return {"actor": actor, "config_dir": cfg_dir, "base": base, "target": target}


def local_base(base_model: str | None) -> Path:
    """--base_model resolved; refused when nothing is there (a Hub id, a typo). Merge and serve both ask."""
    base = Path(base_model or "").expanduser()
    if not base.exists():
        raise UsageError(
            f"--base_model {base_model} is not a local directory; download the base first "
            "(e.g. `hf download ORG/REPO --local-dir DIR`) and pass that directory"
        )
    return base.resolve()


def check_base_fits(config: ModelMergerConfig, base: Path) -> BaseLayout:
    """The base's layout, once its kind fits the output format and it has the component (merge and serve)."""
    layout = base_layout(base, config.component)
    check_output_format(config, layout)
    model_output(config.output_format).check_component(config, layout)
    return layout


def check_output_format(config: ModelMergerConfig, layout: BaseLayout) -> None:
    """The output's need of the base (a pipeline output needs a pipeline base) and its --quantize values;
    said before any work."""
    output = model_output(config.output_format)
    output.check_quantize(config)
    output.check_base(config, layout)


def _check_lora_flag_values(config: ModelMergerConfig) -> None:
    """LoRA flags that contradict each other or name no file: refused whatever the checkpoint holds."""
    if config.fuse_lora and config.adapter_format != DEFAULT_ADAPTER_FORMAT:  # the flag given
        raise UsageError("--adapter-format chooses how an adapter is exported; with --fuse-lora no adapter is written")
    if config.adapter_config and not Path(config.adapter_config).expanduser().is_file():
        raise UsageError(f"--adapter-config {config.adapter_config} is not a file")


def check_lora_flags(config: ModelMergerConfig, has_meta: bool) -> None:
    """LoRA flags the flow refuses whatever the rank files hold."""
    _check_lora_flag_values(config)
    if has_meta:
        from mergeflow.lora.detect import refuse_quantized_adapter

        refuse_quantized_adapter(config)  # before any work: the adapter would be the artifact
        return
    # Without lora_train_meta.json the flow refuses LoRA flags: either the checkpoint has no
    # adapters, or it has some whose r and lora_alpha are unknown.
    used = config.lora_flags()
    if used:
        raise UsageError(f"{used[0]} is for LoRA checkpoints, but this one has no {LORA_META} (a LoRA run's "
                         f"actor directory holds it); drop {used[0]} or copy {LORA_META} from the training run")


def preflight_with_base(config: ModelMergerConfig) -> None:
    """Every export except a LoRA-only adapter needs a local base: paths, layout, classes."""
    paths = resolve_inputs(config)
    layout = check_base_fits(config, paths["base"])
    actor_config = _read_config(paths["config_dir"] / "config.json", CheckpointError, CHECKPOINT_CONFIG)
    if model_output(config.output_format).compares_classes(config, layout):
        _check_same_diffusers_class(actor_config, paths["base"], layout)


def preflight_dcp(config: ModelMergerConfig, actor: Path) -> None:
    """A DCP: whether it holds LoRA is in `.metadata` (a pickle, read by the flow), so only what every
    branch checks: the LoRA flags' own consistency, target and overlaps, and a local base's layout and
    classes (the model config is --hf_model_config_path's, else the base's own)."""
    _check_lora_flag_values(config)
    target = check_target(Path(config.target_dir or ""))
    check_no_overlap({"--local_dir": actor, "--target_dir": target})
    base_arg = Path(config.base_model or "").expanduser()
    cfg_dir = Path(config.hf_model_config_path or "").expanduser().resolve() if config.model_config_given() else None
    if cfg_dir is not None:
        check_no_overlap({"--hf_model_config_path": cfg_dir, "--target_dir": target})
    if not base_arg.is_dir():
        if cfg_dir is None:  # the flow could not plan either: a DCP carries no model config
            raise UsageError(NO_MODEL_CONFIG)
        return  # a Hub id: only a LoRA-only adapter export can take it, which the flow decides
    base = base_arg.resolve()
    check_no_overlap({"--local_dir": actor, "--base_model": base, "--target_dir": target})
    layout = base_layout(base, config.component)
    check_output_format(config, layout)
    if cfg_dir is not None:
        check_no_overlap({"--hf_model_config_path": cfg_dir, "--base_model": base})
        actor_config = _read_config(cfg_dir / "config.json", CheckpointError, "config.json of --hf_model_config_path")
        if model_output(config.output_format).compares_classes(config, layout):
            _check_same_diffusers_class(actor_config, base, layout)


def preflight_maybe_adapter(config: ModelMergerConfig, actor: Path) -> None:
    """A LoRA run: only the rank files' keys tell a LoRA-only save (no base needed) from a full one.

    So only what both inspections check: target and overlaps, and the base when it is a directory.
    """
    cfg_dir = Path(config.hf_model_config_path or actor / "huggingface").expanduser().resolve()
    target = check_target(Path(config.target_dir or ""))
    check_no_overlap({"--local_dir": actor, "--target_dir": target})
    check_no_overlap({"--hf_model_config_path": cfg_dir, "--target_dir": target})
    actor_config = _read_config(cfg_dir / "config.json", CheckpointError, CHECKPOINT_CONFIG)
    base_arg = Path(config.base_model or "").expanduser()
    if not base_arg.is_dir():  # a Hub id: the adapter export takes the schema from the class alone
        _check_known_class(_checkpoint_class(actor_config))
        return
    base = base_arg.resolve()
    check_no_overlap({"--local_dir": actor, "--base_model": base, "--target_dir": target})
    layout = base_layout(base, config.component)
    if model_output(config.output_format).compares_classes(config, layout):
        _check_same_diffusers_class(actor_config, base, layout)


def _read_config(path: Path, error: type[CheckpointError] | type[BaseModelError], what: str) -> ModelConfig:
    data = read_json_strict(path, error, what)
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object")
    return data


def _checkpoint_class(actor_config: ModelConfig) -> str:
    name = actor_config.get("_class_name")
    if not isinstance(name, str):
        raise CheckpointError("huggingface/config.json of the checkpoint has no _class_name")
    return name


def _check_same_diffusers_class(actor_config: ModelConfig, base: Path, layout: BaseLayout) -> None:
    """The checks of the flow's Diffusers schema step that need only the two configs."""
    path = layout.transformer_dir / "config.json"
    base_config = _read_config(path, BaseModelError, f"{path.relative_to(base)} of the base")
    actor_class, base_class = _checkpoint_class(actor_config), base_config.get("_class_name")
    if actor_class != base_class:
        raise SchemaMismatchError(f"the checkpoint is a {actor_class} but the base transformer is a {base_class}")
    _check_known_class(actor_class)


def _check_known_class(class_name: str) -> None:
    """Refuse a class that diffusers does not export, without importing diffusers (and torch)."""
    names = _diffusers_exported_names()
    if names is not None and class_name not in names:
        raise BaseModelError(f"unknown model class {class_name!r}: it is not a Diffusers model class in "
                             f"diffusers {_diffusers_version()}")


_QUOTED = re.compile(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']")


@lru_cache(maxsize=1)
def _diffusers_exported_names() -> frozenset[str] | None:
    """Every name diffusers' package `__init__` declares, read from its source; None when unsure.

    diffusers exposes its classes through a lazy module built from string lists in
    `__init__.py`, so a name missing there cannot be a Diffusers class. Reading the file
    takes a millisecond; importing diffusers takes seconds and imports torch. If the file
    no longer looks like that (a future diffusers), this returns None and the flow decides.
    """
    spec = importlib.util.find_spec("diffusers")  # a top-level name: located, not imported
    if spec is None or spec.origin is None:
        return None
    try:
        text = Path(spec.origin).read_text(encoding="utf-8")
    except OSError:
        return None
    names = frozenset(_QUOTED.findall(text))
    return names if {"ModelMixin", "FluxTransformer2DModel"} <= names else None


def _diffusers_version() -> str:
    from mergeflow.formats.manifest import installed_version

    return installed_version("diffusers") or "(not installed)"


def require_local_dir(actor: Path) -> None:
    """Refuse a --local_dir that is not a directory; a missing one names the run's nearest checkpoints.

    A typo in the step (global_step_70 where the run saved 60 and 80) is the usual cause, so the
    message lists the existing `global_step_N/actor` directories nearest to the step asked for.
    """
    if actor.is_dir():
        return
    if actor.exists():
        raise CheckpointError(f"--local_dir {actor} is not a directory")
    nearest = nearest_checkpoints(actor)
    hint = f"; the nearest checkpoints of that run: {', '.join(map(str, nearest))}" if nearest else ""
    raise CheckpointError(f"--local_dir {actor} does not exist{hint}")


def nearest_checkpoints(missing: Path, count: int = 3) -> list[Path]:
    """The existing checkpoint directories of the training run `missing` points into, nearest step first.

    The run is the parent of the path's `global_step_N` part, else the nearest existing ancestor.
    Each result is the directory to pass: `global_step_M/actor` where verl saved one, else `global_step_M`.
    """
    wanted = next((step for step in map(step_of, reversed(missing.parts)) if step is not None), None)
    run = next((p.parent for p in (missing, *missing.parents) if step_of(p.name) is not None), None)
    if run is None:
        run = next((p for p in missing.parents if p.is_dir()), None)
    if run is None or not run.is_dir():
        return []
    try:
        steps = [(n, p) for p in run.iterdir() if (n := step_of(p.name)) is not None and p.is_dir()]
    except OSError:  # an unreadable run directory: no hint rather than a second error
        return []
    # Nearest to the step asked for (the later one on a tie); without one, the latest.
    steps.sort(key=lambda item: (abs(item[0] - wanted), -item[0]) if wanted is not None else -item[0])
    return [p / "actor" if (p / "actor").is_dir() else p for _, p in steps[:count]]
