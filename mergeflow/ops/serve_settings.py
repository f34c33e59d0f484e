"""What `mergeflow serve` serves with, checked before a Prefect server is chosen or Prefect is imported.

`ServeSettings.checked()` is serve's pre-flight: the roots exist, the choices are known, and the
base models pass merge's own base checks (`mergeflow/export/plan/input_checks.py`), so settings that
would fail every triggered run are refused at start-up with one line. No Prefect here: the
command line runs this before it points Prefect at a server (Prefect reads that when imported).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_QUANTIZE,
    DEFAULT_TASK_RUNNER,
    DEFAULT_WORKERS,
    DTYPES,
    MAX_WORKERS,
    OUTPUT_FORMATS,
    QUANTIZATIONS,
    TASK_RUNNERS,
    Dtype,
    ModelMergerConfig,
    OutputFormat,
    Quantize,
    SmokeDevice,
    TaskRunner,
)
from mergeflow.errors import MergeflowError, UsageError
from mergeflow.export.plan.input_checks import check_base_fits, local_base
from mergeflow.io.jsonfiles import JsonObject


def format_with_checkpoint(template: str | None, run_name: str, step: int | None, what: str) -> str | None:
    """Fill `{run_name}` and `{step}` in a per-checkpoint setting such as --hf_upload_path."""
    if template is None:
        return None
    try:
        return template.format(run_name=run_name, step="" if step is None else step)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise UsageError(f"{what} may use only {{run_name}} and {{step}}: {exc!r}") from None


@dataclass(frozen=True)
class ServeSettings:
    """Defaults of every triggered merge (an event's payload may override base_model and target)."""

    base_model: str
    target_root: str
    output_format: OutputFormat = DEFAULT_OUTPUT_FORMAT
    dtype: Dtype = DEFAULT_DTYPE
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    hf_upload_path: str | None = None
    private: bool = False
    workers: int = DEFAULT_WORKERS
    task_runner: TaskRunner = DEFAULT_TASK_RUNNER
    dask_address: str | None = None
    # Where events may point: checkpoints below these roots, and these base models besides base_model.
    checkpoint_roots: tuple[str, ...] = ()
    allowed_base_models: tuple[str, ...] = ()
    quantize: Quantize = DEFAULT_QUANTIZE
    extract_lora: int | None = None  # --extract-lora: every triggered export is a LoRA of (trained - base)
    extract_energy: float | None = None
    sign_key: str | None = None  # --sign-key: every triggered export is signed before it is published
    smoke: bool = False  # --smoke: the runtime check (one denoising step) before each publication
    smoke_device: SmokeDevice = "cpu"
    base_model_id: str | None = None  # the model cards' base_model when base_model is a local folder

    def checked(self) -> ServeSettings:
        """Absolute paths, known choices; refuse what every triggered run would fail on."""
        base = local_base(self.base_model)
        root = Path(self.target_root).expanduser().resolve()
        if not root.is_dir():
            raise UsageError(f"--target-root {self.target_root} does not exist; create it first")
        if not self.checkpoint_roots:
            raise UsageError("--checkpoint-root is required: events may only name checkpoints below it (repeat it for several)")
        checkpoint_roots = tuple(_existing_dir(p, "--checkpoint-root") for p in self.checkpoint_roots)
        allowed = tuple(_existing_dir(p, "--allow-base-model") for p in self.allowed_base_models)
        if self.output_format not in OUTPUT_FORMATS:
            raise UsageError(f"--output_format must be one of {', '.join(OUTPUT_FORMATS)}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.quantize not in QUANTIZATIONS:
            raise UsageError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}")
        if self.task_runner not in TASK_RUNNERS:
            raise UsageError(f"--task-runner must be one of {', '.join(TASK_RUNNERS)}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise UsageError(f"--workers must be between 1 and {MAX_WORKERS}")
        if isinstance(self.max_shard_size, bool) or not isinstance(self.max_shard_size, int) or self.max_shard_size <= 0:
            raise UsageError(f"--max_shard_size must be a positive number of bytes, not {self.max_shard_size!r}")
        format_with_checkpoint(self.hf_upload_path, "run", 0, "--hf_upload_path")
        from mergeflow.lora.extract_spec import check_settings

        check_settings(self.extract_lora, self.extract_energy)
        sign_key = None
        if self.sign_key:  # a wrong key is refused at serve time, not in every triggered run
            from mergeflow.signing import load_signing_key

            load_signing_key(self.sign_key)
            sign_key = str(Path(self.sign_key).expanduser().resolve())
        # Every base an event may merge onto must fit the output format, as merge checks its one base.
        check_base_fits(ModelMergerConfig(base_model=str(base), output_format=self.output_format, quantize=self.quantize), base)
        for other in allowed:
            try:
                check_base_fits(ModelMergerConfig(base_model=other, output_format=self.output_format, quantize=self.quantize),
                                Path(other))
            except MergeflowError as exc:
                raise type(exc)(f"--allow-base-model {other}: {exc}") from None
        return ServeSettings(**{**asdict(self), "base_model": str(base), "target_root": str(root),
                                "checkpoint_roots": checkpoint_roots, "allowed_base_models": allowed,
                                "sign_key": sign_key})

    def parameters(self) -> JsonObject:
        """The merge deployment's default parameters (the trigger adds `checkpoint`)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def backfill_parameters(self) -> JsonObject:
        """The backfill deployment's defaults: the merge's, less what only an event's merge uses.

        A run supplies train_dir. No upload settings: `mergeflow backfill` publishes locally only.
        """
        merge = self.parameters()
        keep = ("base_model", "target_root", "output_format", "dtype", "max_shard_size", "workers", "task_runner",
                "dask_address", "checkpoint_roots", "quantize", "extract_lora", "extract_energy", "sign_key", "smoke",
                "smoke_device", "base_model_id")
        return {k: merge[k] for k in keep}


def _existing_dir(path: str, flag: str) -> str:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise UsageError(f"{flag} {path} is not a directory")
    return str(resolved)
