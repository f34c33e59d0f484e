"""The trained model's schema from configs alone: meta-device instantiation and comparisons."""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergeflow.errors import BaseModelError, SchemaMismatchError
from mergeflow.formats.model_config import ModelConfig
from mergeflow.formats.rank_files import dtype_name
from mergeflow.io.jsonfiles import read_json_strict


def diffusers_model_class(class_name: str) -> type:
    """The Diffusers model class named by `_class_name`; anything else is refused."""
    import diffusers
    from diffusers import ModelMixin

    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        raise BaseModelError(f"unknown model class {class_name!r}: it is not a Diffusers model class in diffusers {diffusers.__version__}")
    return cls


# How many tensors a config may make a meta build register when the caller knows no better bound:
# some 30 times the largest model mergeflow knows (LTX-2: 3,510). Building takes about 75 us a
# tensor or module on the meta device, so even this stops a runaway build in about ten seconds
# and a few hundred MB.
DEFAULT_MAX_TENSORS = 100_000
# A budget drawn from a checkpoint: the tensors its rank files hold, times this, plus the slack (a
# LoRA-only save holds a handful of adapter tensors of a model of thousands).
CHECKPOINT_FACTOR = 4
CHECKPOINT_SLACK = 10_000
# Modules registered per tensor allowed (the known models have 1.0-1.8, parameter-free ones included).
MODULES_PER_TENSOR = 4


@dataclass(frozen=True)
class TensorBudget:
    """The most tensors a meta build may register, what that rests on, and the configs it guards.

    A config is input: `"num_layers": 1000000000` would otherwise build modules for hours. The
    bound comes from what is really there (the tensors the rank files hold), not from a config.
    The two configs only make the refusal say which file is wrong and which values.
    """

    max_tensors: int
    evidence: str = ""  # what the bound rests on, as the refusal quotes it: "the rank files hold 1,156"
    checkpoint_config: ModelConfig | None = None
    base_config: ModelConfig | None = None

    @classmethod
    def for_checkpoint(cls, tensors_held: int, checkpoint_config: ModelConfig | None = None,
                       base_config: ModelConfig | None = None) -> TensorBudget:
        return cls(CHECKPOINT_FACTOR * tensors_held + CHECKPOINT_SLACK, f"the rank files hold {tensors_held:,} tensors",
                   checkpoint_config, base_config)

    def refusal(self, class_name: str, config: ModelConfig, size: str) -> SchemaMismatchError:
        """One line: which config, how large it came out, the values that look wrong, what it is held against."""
        if self.checkpoint_config is not None and config == self.checkpoint_config:
            what, other, other_name = "huggingface/config.json of the checkpoint", self.base_config, "the base"
        elif self.base_config is not None and config == self.base_config:
            what, other, other_name = "config.json of the base", self.checkpoint_config, "the checkpoint"
        else:
            what, other, other_name = "the config", None, ""
        hint = _suspects(config, other, other_name)
        against = f"but {self.evidence}" if self.evidence else "more than any real model has"
        return SchemaMismatchError(f"{what} describes a {class_name} of {size}{f' ({hint})' if hint else ''}, "
                                   f"{against}; fix the config")


def _suspects(config: ModelConfig, other: ModelConfig | None, other_name: str) -> str:
    """The integer fields that most likely blew the size up: those that differ from the other config, else the largest."""
    ints = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_")}
    if other is not None:
        differ = sorted((k for k in ints if other.get(k) != ints[k]), key=lambda k: -ints[k])[:2]
        if differ:
            return "; ".join(f"{k}={ints[k]} where {other_name} has {other[k]!r}" if k in other
                             else f"{k}={ints[k]}, which {other_name} does not set" for k in differ)
    largest = sorted(ints, key=lambda k: -ints[k])[:2]
    return f"largest values {', '.join(f'{k}={ints[k]}' for k in largest)}" if largest else ""


_DEFAULT_BUDGET = TensorBudget(DEFAULT_MAX_TENSORS)
_BUDGET: ContextVar[TensorBudget | None] = ContextVar("mergeflow_tensor_budget", default=None)


@contextmanager
def tensor_budget(budget: TensorBudget) -> Iterator[None]:
    """Every meta build inside (model_schema, meta_model) is held to `budget` unless given its own.

    For callers that build schemas several calls deep (the architecture adapters): the planner
    knows the checkpoint, the adapter knows the configs.
    """
    token = _BUDGET.set(budget)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def current_budget(budget: TensorBudget | None = None) -> TensorBudget:
    return budget or _BUDGET.get() or _DEFAULT_BUDGET


class _OverBudget(Exception):
    pass


class _Meter:
    """Counts what a build registers, in the building thread only, and stops it past the budget.

    The registration hooks are process-wide; another thread building at the same time is not ours.
    Once over, every further registration raises again, so a constructor that swallows one
    exception cannot build on.
    """

    def __init__(self, budget: TensorBudget) -> None:
        self.owner = threading.get_ident()
        self.max_tensors = budget.max_tensors
        self.max_modules = MODULES_PER_TENSOR * budget.max_tensors + 1_000
        self.tensors = 0
        self.modules = 0

    def exceeded(self) -> str | None:
        if self.tensors > self.max_tensors:
            return f"more than {self.max_tensors:,} tensors"
        if self.modules > self.max_modules:
            return f"more than {self.max_modules:,} modules"
        return None

    def tensor(self, module: object, name: str, value: object) -> None:
        if threading.get_ident() == self.owner:
            self.tensors += 1
            if self.tensors > self.max_tensors:
                raise _OverBudget

    def module(self, module: object, name: str, submodule: object) -> None:
        if threading.get_ident() == self.owner:
            self.modules += 1
            if self.modules > self.max_modules:
                raise _OverBudget


_quiet_lock = threading.Lock()
_quiet_builds = 0  # meta builds running (threads of one process); the first saves diffusers' level, the last restores it
_saved_verbosity = 0


@contextmanager
def _quiet_diffusers() -> Iterator[None]:
    """Diffusers' own log lines (not Python warnings) held to errors while a config builds its class: "The config
    attributes {...} were passed to X, but are not expected and will be ignored" would reach the user's terminal
    mid-export for a key the class does not take, which the schema comparison judges. mergeflow's own messages
    do not go through diffusers' logger."""
    from diffusers.utils import logging as diffusers_logging

    global _quiet_builds, _saved_verbosity
    with _quiet_lock:
        if _quiet_builds == 0:
            _saved_verbosity = diffusers_logging.get_verbosity()
            diffusers_logging.set_verbosity_error()
        _quiet_builds += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_builds -= 1
            if _quiet_builds == 0:
                diffusers_logging.set_verbosity(_saved_verbosity)


def meta_model(cls: type, config: ModelConfig, budget: TensorBudget | None = None) -> torch.nn.Module:
    """Instantiate `cls` from `config` on the meta device: shapes without memory, work held to `budget`."""
    from torch.nn.modules import module as nn_module

    budget = current_budget(budget)
    meter = _Meter(budget)
    hooks = [nn_module.register_module_parameter_registration_hook(meter.tensor),
             nn_module.register_module_buffer_registration_hook(meter.tensor),
             nn_module.register_module_module_registration_hook(meter.module)]
    try:
        with warnings.catch_warnings(), _quiet_diffusers():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                try:
                    return cls.from_config(config)
                except Exception as exc:  # noqa: BLE001 - whatever the library raises, the user gets one line
                    over = meter.exceeded()  # _OverBudget itself, or whatever the library wrapped it in
                    if over is not None:
                        raise budget.refusal(cls.__name__, config, over) from None
                    raise SchemaMismatchError(f"{cls.__name__} cannot be built from this config ({type(exc).__name__}: {exc})") from None
    finally:
        for hook in hooks:
            hook.remove()


def constructor_fields(cls: type) -> list[str]:
    params = inspect.signature(cls.__init__).parameters
    return [n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _normal(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def config_differences(cls: type, actor: torch.nn.Module, base: torch.nn.Module) -> list[str]:
    """Constructor fields on which two instantiated models disagree (defaults filled in)."""
    diffs = []
    for name in constructor_fields(cls):
        a, b = _normal(actor.config.get(name)), _normal(base.config.get(name))
        if a != b:
            diffs.append(f"{name}: checkpoint {a!r} vs base {b!r}")
    return diffs


@dataclass(frozen=True)
class ModelSchema:
    """What a Diffusers class builds from a config: its constructor fields (defaults filled in),
    the meta module's state_dict() shapes and the modules kept in float32."""

    class_name: str
    fields: ModelConfig
    tensors: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]

    def differences(self, other: ModelSchema) -> list[str]:
        """Constructor fields on which two schemas disagree, as `name: checkpoint X vs base Y`."""
        names = sorted(set(self.fields) | set(other.fields))
        return [f"{n}: checkpoint {self.fields.get(n)!r} vs base {other.fields.get(n)!r}"
                for n in names if self.fields.get(n) != other.fields.get(n)]


SCHEMA_CACHE_VERSION = 1


def model_schema(class_name: str, config: ModelConfig, budget: TensorBudget | None = None) -> ModelSchema:
    """The schema `class_name` builds from `config` on the meta device, remembered on disk.

    Instantiating the class is cheap; importing Diffusers to get at it costs 2-3 s of every
    command. The result is a pure function of the class, the config and the installed
    diffusers and torch, which together key a small JSON file in the user's cache
    (MERGEFLOW_CACHE_DIR, else $XDG_CACHE_HOME/mergeflow), so the exports of one base skip the
    import after the first. A missing, damaged or foreign cache entry is simply rebuilt;
    MERGEFLOW_SCHEMA_CACHE=0 turns the cache off.

    The build is held to `budget` (else the enclosing `tensor_budget`, else DEFAULT_MAX_TENSORS),
    and so is a remembered schema: the answer never depends on the cache. A refused config is
    never remembered.
    """
    budget = current_budget(budget)
    path = _schema_cache_path(class_name, config)
    cached = _read_schema(path, class_name) if path is not None else None
    if cached is not None:
        if len(cached.tensors) > budget.max_tensors:
            raise budget.refusal(class_name, config, f"{len(cached.tensors):,} tensors")
        return cached
    cls = diffusers_model_class(class_name)
    model = meta_model(cls, config, budget)
    schema = ModelSchema(
        class_name=class_name,
        fields={name: _normal(model.config.get(name)) for name in constructor_fields(cls)},
        tensors={k: tuple(v.shape) for k, v in model.state_dict().items()},
        keep_fp32=keep_in_fp32_modules(cls),
    )
    if path is not None:
        _write_schema(path, schema)
    return schema


def _schema_cache_path(class_name: str, config: ModelConfig) -> Path | None:
    import hashlib
    import json
    import os
    from mergeflow.formats.manifest import installed_version

    if os.environ.get("MERGEFLOW_SCHEMA_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    versions = {name: installed_version(name) for name in ("diffusers", "torch")}
    if None in versions.values():
        return None
    try:
        raw = json.dumps({"v": SCHEMA_CACHE_VERSION, "class": class_name, "config": config, **versions},
                         sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None
    root = os.environ.get("MERGEFLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mergeflow")
    return Path(root) / "schemas" / f"{hashlib.sha256(raw.encode()).hexdigest()}.json"


def _read_schema(path: Path, class_name: str) -> ModelSchema | None:
    import json

    try:
        data = json.loads(path.read_text())
        schema = ModelSchema(
            class_name=data["class_name"],
            fields=dict(data["fields"]),
            tensors={str(k): tuple(int(d) for d in v) for k, v in data["tensors"].items()},
            keep_fp32=tuple(str(m) for m in data["keep_fp32"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return schema if schema.class_name == class_name and schema.tensors else None


def _write_schema(path: Path, schema: ModelSchema) -> None:
    import json
    import os

    data = {"class_name": schema.class_name, "fields": schema.fields,
            "tensors": {k: list(v) for k, v in schema.tensors.items()}, "keep_fp32": list(schema.keep_fp32)}
    try:
        text = json.dumps(data, sort_keys=True, allow_nan=False)
        if json.loads(text)["fields"] != schema.fields:
            return  # a field JSON cannot hold exactly (e.g. int dict keys): never cache an approximation
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except (OSError, TypeError, ValueError):
        pass  # the cache is an optimisation: a read-only or full cache dir costs the import, nothing else


@dataclass(frozen=True)
class ExpectedTensor:
    shape: tuple[int, ...]
    dtype: str  # dtype of the meta instantiation (informative only)


def expected_tensors(model: torch.nn.Module) -> dict[str, ExpectedTensor]:
    """The exact tensor set a checkpoint must cover: the meta module's state_dict()."""
    return {k: ExpectedTensor(tuple(v.shape), dtype_name(v.dtype)) for k, v in model.state_dict().items()}


def keep_in_fp32_modules(cls: type) -> tuple[str, ...]:
    return tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())


def is_kept_in_fp32(key: str, modules: tuple[str, ...]) -> bool:
    """Diffusers' loading rule: a tensor stays float32 if a module name is one of its dotted parts."""
    parts = key.split(".")
    return any(m in parts for m in modules)


def read_model_config(path: Path, error: type, what: str) -> ModelConfig:
    data = read_json_strict(path, error, what)
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object")
    return data
