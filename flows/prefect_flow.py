"""mergeflow's flows: Prefect's `Flow`, with parameters stored without importing FastAPI.

Prefect (3.9) stores a flow run's parameters (what the UI shows and a rerun starts from) through
FastAPI's `jsonable_encoder`, imported on every flow call: importing FastAPI (and Starlette) costs
0.2-0.4 s of every `mergeflow merge`, more than the flow run of a tiny model spends on its server.
Our flows take JSON values and plain dataclasses of them (`ModelMergerConfig`), whose encoding is
written out here to give exactly what `jsonable_encoder` gives (a test compares the two); any other
value goes through Prefect's own path, FastAPI included, so nothing is ever stored differently.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import PurePath
from typing import Any, TypeVar

from prefect import Flow
from prefect.task_runners import TaskRunner

F = TypeVar("F", bound=Callable[..., Any])


class _Unencodable(Exception):
    """A value outside the plain JSON values and dataclasses this module encodes."""


def json_parameter(value: Any) -> Any:
    """The JSON form of a flow parameter built from JSON values, paths, tuples and dataclasses of them."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [json_parameter(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: json_parameter(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: json_parameter(getattr(value, field.name)) for field in dataclasses.fields(value)}
    raise _Unencodable(type(value).__name__)


class MergeflowFlow(Flow):  # type: ignore[type-arg]
    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            return {key: json_parameter(value) for key, value in parameters.items()}
        except _Unencodable:
            return super().serialize_parameters(parameters)

    def with_options(self, *args: Any, **kwargs: Any) -> MergeflowFlow:
        if not args and kwargs.keys() == {"task_runner"} and isinstance(kwargs["task_runner"], TaskRunner):
            # Every export picks its task runner this way. Prefect's with_options builds a new Flow, whose
            # parameter schema (pydantic models) took 20 ms of each call; this copy differs from that one
            # only in the runner (a test compares them), which each run duplicates before use anyway.
            fast = copy.copy(self)
            fast.task_runner = kwargs["task_runner"]
            return fast
        rebuilt = super().with_options(*args, **kwargs)  # Prefect builds a plain Flow: keep this class
        rebuilt.__class__ = type(self)
        return rebuilt  # type: ignore[return-value]


def flow(**options: Any) -> Callable[[F], MergeflowFlow]:
    """`@prefect.flow(**options)`, making a `MergeflowFlow`."""

    def decorate(fn: F) -> MergeflowFlow:
        return MergeflowFlow(fn=fn, **options)

    return decorate
