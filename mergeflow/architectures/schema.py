"""The trained model's schema from configs alone: meta-device instantiation and comparisons."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergeflow.errors import BaseModelError, SchemaMismatchError
from mergeflow.formats.rank_files import dtype_name
from mergeflow.io.jsonfiles import JsonObject, read_json_strict


def diffusers_model_class(class_name: str) -> type:
    """The Diffusers model class named by `_class_name`; anything else is refused."""
    import diffusers
    from diffusers import ModelMixin

    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        raise BaseModelError(f"unknown model class {class_name!r}: it is not a Diffusers model class in diffusers {diffusers.__version__}")
    return cls


def meta_model(cls: type, config: JsonObject) -> torch.nn.Module:
    """Instantiate `cls` from `config` on the meta device: shapes without memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            try:
                return cls.from_config(config)
            except Exception as exc:
                raise SchemaMismatchError(f"{cls.__name__} cannot be built from this config ({type(exc).__name__}: {exc})") from None


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
    fields: JsonObject
    tensors: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]

    def differences(self, other: "ModelSchema") -> list[str]:
        """Constructor fields on which two schemas disagree, as `name: checkpoint X vs base Y`."""
        names = sorted(set(self.fields) | set(other.fields))
        return [f"{n}: checkpoint {self.fields.get(n)!r} vs base {other.fields.get(n)!r}"
                for n in names if self.fields.get(n) != other.fields.get(n)]


SCHEMA_CACHE_VERSION = 1


def model_schema(class_name: str, config: JsonObject) -> ModelSchema:
    """The schema `class_name` builds from `config` on the meta device, remembered on disk.

    Instantiating the class is cheap; importing Diffusers to get at it costs 2-3 s of every
    command. The result is a pure function of the class, the config and the installed
    diffusers and torch, which together key a small JSON file in the user's cache
    (MERGEFLOW_CACHE_DIR, else $XDG_CACHE_HOME/mergeflow), so the exports of one base skip the
    import after the first. A missing, damaged or foreign cache entry is simply rebuilt;
    MERGEFLOW_SCHEMA_CACHE=0 turns the cache off.
    """
    path = _schema_cache_path(class_name, config)
    cached = _read_schema(path, class_name) if path is not None else None
    if cached is not None:
        return cached
    cls = diffusers_model_class(class_name)
    model = meta_model(cls, config)
    schema = ModelSchema(
        class_name=class_name,
        fields={name: _normal(model.config.get(name)) for name in constructor_fields(cls)},
        tensors={k: tuple(v.shape) for k, v in model.state_dict().items()},
        keep_fp32=keep_in_fp32_modules(cls),
    )
    if path is not None:
        _write_schema(path, schema)
    return schema


def _schema_cache_path(class_name: str, config: JsonObject) -> Path | None:
    import hashlib
    import json
    import os
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("MERGEFLOW_SCHEMA_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    try:
        versions = {name: version(name) for name in ("diffusers", "torch")}
        raw = json.dumps({"v": SCHEMA_CACHE_VERSION, "class": class_name, "config": config, **versions},
                         sort_keys=True, allow_nan=False)
    except (PackageNotFoundError, TypeError, ValueError):
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


def read_model_config(path: Path, error: type, what: str) -> JsonObject:
    data = read_json_strict(path, error, what)
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object")
    return data
