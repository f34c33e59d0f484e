"""One error hierarchy. Every message says what is wrong and what the user can do."""

from __future__ import annotations


class MergeflowError(Exception):
    """Base of every error mergeflow raises on purpose; the CLI prints it as one line."""

    exit_code = 2


class UsageError(MergeflowError):
    """Flags or config values that cannot work together."""


class CheckpointError(MergeflowError):
    """The training checkpoint (rank files, fsdp_config.json, metadata) is unusable."""


class UnsafeCheckpointError(CheckpointError):
    """A rank file needs full unpickling, which runs arbitrary code."""


class ShardLayoutError(CheckpointError):
    """Local shards do not add up to the declared global tensor."""


class BaseModelError(MergeflowError):
    """The base model directory is incomplete, unknown or inconsistent."""


class SchemaMismatchError(MergeflowError):
    """Checkpoint and base disagree (config field, tensor set, shape)."""


class LoraError(MergeflowError):
    """LoRA adapters or their metadata are inconsistent."""


class CastError(MergeflowError):
    """A requested dtype cast would overflow or produce non-finite values."""


class PathSafetyError(MergeflowError):
    """A path would escape its directory, overlap another input, or replace an existing one."""


class TargetExistsError(PathSafetyError):
    """The target directory exists; mergeflow never overwrites."""


class ConcurrentExportError(MergeflowError):
    """Another export to the same target holds the lock."""


class InputChangedError(MergeflowError):
    """An input file changed while the export was reading it."""


class DiskFullError(MergeflowError):
    """The output filesystem ran out of space (or hit a file size limit) while writing."""


class ValidationError(MergeflowError):
    """An artifact (staged or published) fails validation."""


class UploadError(MergeflowError):
    """Uploading to or verifying on the Hugging Face Hub failed."""


class UploadAuthError(UploadError):
    """The Hub refused the credentials (401/403/404): retrying cannot help."""


class EventError(MergeflowError):
    """An event could not be emitted (e.g. no Prefect API configured)."""


class UploadTransientError(UploadError):
    """The Hub or the network kept failing with transient errors; a later retry may succeed."""


class UploadVerificationError(UploadError):
    """The files on the Hub differ from the artifact's manifest after an upload."""
