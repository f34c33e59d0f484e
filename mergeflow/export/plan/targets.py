"""What an export writes, decided from metadata: the `TargetSchema` every output's plan returns.

The schema the checkpoint must cover, where and how the weights go, and (for pipelines) every
base file with its sha256 and the files to copy. Each output (mergeflow/outputs/) builds it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.architectures.adapters import diffusers_schema  # noqa: F401  (lora/detect.py imports it from here)
from mergeflow.formats.manifest import ArtifactType
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import carry_session, sha256_file
from mergeflow.records import Conversion


@dataclass(frozen=True)
class TargetSchema:
    """The artifact an export produces and the schema it must satisfy."""

    architecture: str
    transformer_class: str
    component_dir: Path
    tensor_directory: str
    artifact_type: ArtifactType
    weights_name: str
    expected_shapes: dict[str, tuple[int, ...]]
    keep_fp32: tuple[str, ...]
    base_files: dict[str, str]
    base_stamps: dict[str, FileStamp]
    output: str  # the registry name of the output (mergeflow.outputs.registry)
    copy_files: tuple[str, ...] = ()
    conversion: Conversion = field(default_factory=Conversion)
    base_weights: str | None = None  # the base's weights name, when the artifact's differs (OutputTarget.base_weights)
    header_metadata: dict[str, str] | None = None  # the weight files' header metadata (OutputTarget.header_metadata)

    @property
    def base_weights_name(self) -> str:
        return self.base_weights or self.weights_name


def hash_base_files(base: Path, files: tuple[str, ...], workers: int) -> dict[str, str]:
    """sha256 of every base file, largest first across a few threads (hashlib releases the GIL)."""
    ordered = sorted(files, key=lambda rel: -(base / rel).stat().st_size)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = dict(zip(ordered, pool.map(carry_session(lambda rel: sha256_file(base / rel)), ordered)))
    return dict(sorted(digests.items()))
