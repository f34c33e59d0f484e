"""The merge configuration (field names of verl-omni's ModelMergerConfig) and its result."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict, get_args

from mergeflow.errors import UsageError

# The choices and defaults of every entry point (CLI flags, served deployments, the checkpoint
# flow's parameters): defined once here, read everywhere else.
# The Literal types are what type checkers (and Prefect's parameter forms) see; the tuples are
# what argparse and the checks below use, derived from them so the two cannot drift.
Operation = Literal["merge", "test"]
Backend = Literal["fsdp"]
OutputFormat = Literal["pipeline", "transformer", "single_file", "gguf"]  # the built-in outputs: the served deployments' form
Dtype = Literal["preserve", "float32", "float16", "bfloat16"]
AdapterFormat = Literal["peft", "diffusers", "comfyui"]
QkvLayout = Literal["interleaved", "stacked"]
# --quantize: how a deployable single file's weights are encoded. "none" keeps the export's dtype;
# fp8 is ComfyUI's scaled float8 (single_file), bf16 and q8_0 are GGUF encodings (gguf). Which
# output takes which value is the output's own (ModelOutput.quantizations).
Quantize = Literal["none", "fp8", "bf16", "q8_0"]
TaskRunner = Literal["thread", "dask"]
SmokeDevice = Literal["cpu", "cuda"]  # where the runtime check runs (mergeflow/ops/smoke.py)
SmokeDtype = Literal["float32", "bfloat16", "float16"]


# The --output_format choices. Owned here, so every entry point reads one list; an output that
# mergeflow.outputs.registry registers later (a plug-in, a test's toy) adds its value to it
# (add_output_format). The list object is shared: argparse choices built from it see later additions.
_OUTPUT_CHOICES: list[str] = list(get_args(OutputFormat))


def add_output_format(value: str) -> None:
    """A registered output's --output_format value becomes a choice of every entry point."""
    if value not in _OUTPUT_CHOICES:
        _OUTPUT_CHOICES.append(value)


def remove_output_format(value: str) -> None:
    """An unregistered output's value is no choice any more (the built-in ones stay)."""
    if value in _OUTPUT_CHOICES and value not in get_args(OutputFormat):
        _OUTPUT_CHOICES.remove(value)


OUTPUT_FORMATS: Sequence[str] = _OUTPUT_CHOICES
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
ADAPTER_FORMATS: tuple[AdapterFormat, ...] = get_args(AdapterFormat)
QKV_LAYOUTS: tuple[QkvLayout, ...] = get_args(QkvLayout)
QUANTIZATIONS: tuple[Quantize, ...] = get_args(Quantize)
TASK_RUNNERS: tuple[TaskRunner, ...] = get_args(TaskRunner)
SMOKE_DEVICES: tuple[SmokeDevice, ...] = get_args(SmokeDevice)
SMOKE_DTYPES: tuple[SmokeDtype, ...] = get_args(SmokeDtype)
DEFAULT_OUTPUT_FORMAT: OutputFormat = "pipeline"
DEFAULT_ADAPTER_FORMAT: AdapterFormat = "peft"
DEFAULT_DTYPE: Dtype = "preserve"
DEFAULT_QUANTIZE: Quantize = "none"
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3
DEFAULT_WORKERS = 2
MAX_WORKERS = 256  # parallel shard writers; on Dask each one a local process
DEFAULT_TASK_RUNNER: TaskRunner = "thread"
SIGN_KEY_ENV = "MERGEFLOW_SIGN_KEY"  # the signing key's path when no --sign-key is given


@dataclass
class ModelMergerConfig:
    """What to merge and how. The first sixteen fields mirror verl-omni's config exactly."""

    operation: Operation = "merge"
    backend: Backend = "fsdp"
    target_dir: str | None = None
    hf_upload_path: str | None = None
    private: bool = False
    test_hf_dir: str | None = None
    trust_remote_code: bool = False
    local_dir: str | None = None
    hf_model_config_path: str | None = None
    base_model: str | None = None
    output_format: str = DEFAULT_OUTPUT_FORMAT  # a registered output's (OUTPUT_FORMATS), checked by validate()
    adapter_name: str = "default"
    dtype: Dtype = DEFAULT_DTYPE
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    trust_checkpoint: bool = False
    fuse_lora: bool = False
    # mergeflow's own additions (all optional, defaults keep the reference behaviour).
    component: str = "transformer"
    adapter_format: AdapterFormat = DEFAULT_ADAPTER_FORMAT
    adapter_config: str | None = None
    qkv_layout: QkvLayout = "interleaved"
    workers: int = DEFAULT_WORKERS
    quantize: Quantize = DEFAULT_QUANTIZE  # the weights' encoding, for the outputs that offer one (--quantize)
    allow_unchanged: bool = False  # publish even when every tensor equals the base's (mergeflow/export/check/unchanged.py)
    # --extract-lora RANK: publish a LoRA of (trained - base) instead of the model (mergeflow/lora/extraction.py);
    # --extract-energy F: per layer the smallest rank that keeps the fraction F of ||dW||, capped at RANK.
    extract_lora: int | None = None
    extract_energy: float | None = None
    # --sign-key PEM: sign the artifact (OpenSSF model signing, mergeflow/signing.py) before it is published;
    # unset, the environment's MERGEFLOW_SIGN_KEY (SIGN_KEY_ENV) applies, in whichever process plans the export.
    sign_key: str | None = None
    # The model card's base_model when the base is a local folder that does not tell its Hub id (mergeflow/hub/model_card.py).
    base_model_id: str | None = None
    # --smoke: run the runtime check (one denoising step, mergeflow/ops/smoke.py) on the staged artifact before publishing.
    smoke: bool = False
    smoke_device: SmokeDevice = "cpu"
    smoke_dtype: SmokeDtype = "float32"

    def __post_init__(self) -> None:
        if self.sign_key is None and self.operation == "merge":
            self.sign_key = os.environ.get(SIGN_KEY_ENV) or None
        if self.hf_model_config_path is None and self.local_dir is not None:
            self.hf_model_config_path = f"{self.local_dir.rstrip('/')}/huggingface"

    def model_config_given(self) -> bool:
        """True when --hf_model_config_path was passed, or its default `<local_dir>/huggingface` holds a config.

        A verl checkpoint always has that default; a DCP has no config of its own, so without this the
        base's is used.
        """
        default = f"{(self.local_dir or '').rstrip('/')}/huggingface"
        if self.hf_model_config_path != default:
            return self.hf_model_config_path is not None
        return os.path.isfile(os.path.join(os.path.expanduser(default), "config.json"))

    def lora_flags(self) -> list[str]:
        """The adapter flags given a non-default value: each needs a LoRA checkpoint (one list, so the
        pre-flight and the flow refuse the same flags on a full checkpoint)."""
        # An extraction writes an adapter from a full checkpoint: --adapter-format picks its format.
        formats = self.adapter_format != DEFAULT_ADAPTER_FORMAT and self.extract_lora is None
        given = (("--fuse-lora", self.fuse_lora), ("--adapter-name", self.adapter_name != "default"),
                 ("--adapter-format", formats), ("--adapter-config", bool(self.adapter_config)))
        return [flag for flag, on in given if on]

    def validate(self) -> None:
        """Refuse flag values that cannot work, before any file is touched."""
        if self.backend != "fsdp":
            raise UsageError(f"--backend {self.backend!r} is not supported; the only backend is 'fsdp'")
        if self.operation == "test":
            if not self.test_hf_dir:
                raise UsageError("test needs --test_hf_dir DIR (a published mergeflow artifact)")
            return
        if self.operation != "merge":
            raise UsageError(f"unknown operation {self.operation!r}; use 'merge' or 'test'")
        if not self.local_dir:
            raise UsageError("merge needs --local_dir (the checkpoint's actor directory)")
        if not self.target_dir:
            raise UsageError("merge needs --target_dir (a directory that does not exist yet)")
        if not self.base_model:
            raise UsageError("merge needs --base_model (a local base pipeline or transformer directory)")
        if self.output_format not in OUTPUT_FORMATS:
            raise UsageError(f"--output_format must be one of {', '.join(OUTPUT_FORMATS)}, not {self.output_format!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if isinstance(self.max_shard_size, bool) or not isinstance(self.max_shard_size, int) or self.max_shard_size <= 0:
            raise UsageError(f"--max_shard_size must be a positive number of bytes, not {self.max_shard_size!r}")
        if not self.adapter_name or "." in self.adapter_name:
            raise UsageError(f"--adapter-name must be non-empty and contain no '.', not {self.adapter_name!r}")
        if self.adapter_format not in ADAPTER_FORMATS:
            raise UsageError(f"--adapter-format must be one of {', '.join(ADAPTER_FORMATS)}")
        if self.quantize not in QUANTIZATIONS:
            raise UsageError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}, not {self.quantize!r}")
        if self.qkv_layout not in QKV_LAYOUTS:
            raise UsageError(f"--qkv-layout must be one of {', '.join(QKV_LAYOUTS)}")
        if not self.component or "/" in self.component or self.component.startswith("."):
            raise UsageError(f"--component must be a component name such as 'transformer', not {self.component!r}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise UsageError(f"--workers must be between 1 and {MAX_WORKERS} (each may be a process on Dask)")
        from mergeflow.lora.extract_spec import check_settings

        check_settings(self.extract_lora, self.extract_energy)
        from mergeflow.hub.model_card import check_base_model_id

        check_base_model_id(self.base_model_id)
        if self.smoke_device not in SMOKE_DEVICES:
            raise UsageError(f"--smoke-device must be one of {', '.join(SMOKE_DEVICES)}, not {self.smoke_device!r}")
        if self.smoke_dtype not in SMOKE_DTYPES:
            raise UsageError(f"--smoke-dtype must be one of {', '.join(SMOKE_DTYPES)}, not {self.smoke_dtype!r}")
        if self.smoke:
            from mergeflow.ops.smoke import check_device

            check_device(self.smoke_device)  # a device this machine lacks: refused before any work
        if self.hf_upload_path is not None and self.hf_upload_path.count("/") != 1:
            raise UsageError(f"--hf_upload_path must look like ORG/REPO, not {self.hf_upload_path!r}")

    def to_dict(self) -> dict[str, str | int | bool | None]:
        return dataclasses.asdict(self)


class UploadSummary(TypedDict):
    """What an upload verified on the Hub (mergeflow.hub.upload.UploadRecord); `upload` and `verify-upload` print it."""

    repo_id: str
    commit_sha: str
    url: str
    files_verified: int
    bytes_verified: int
    private: bool


class UploadOutcome(TypedDict, total=False):
    """A merge's `upload`: "uploaded" and the UploadSummary's fields, or "failed" with the repo and the error."""

    status: Literal["uploaded", "failed"]
    repo_id: str
    commit_sha: str
    url: str
    files_verified: int
    bytes_verified: int
    private: bool
    error: str


class PublishedMerge(TypedDict):
    """The merge flow's result, and `mergeflow merge`'s JSON line (MergeResult is the Python API's record of it)."""

    output_dir: str
    manifest_path: str
    upload: NotRequired[UploadOutcome]


@dataclass(frozen=True)
class MergeResult:
    """Where the published artifact and its manifest are."""

    output_dir: str
    manifest_path: str
    upload: UploadOutcome | None = None
