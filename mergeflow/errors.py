"""One error hierarchy. Every message says what is wrong and what the user can do, in one line.

Each class declares what it carries: `exit_code` (the CLI's exit status), `retryable` (read by the
tasks' retry policy: a refusal of the input stays a refusal on the next try, an I/O hiccup may
not), and, for a failed export, `staging_dir` (the kept work a rerun resumes from). Builtin bases
where they fit: a full disk, a refused access and a failing disk are `OSError`s, so code that handles
OSErrors handles them too (typed from an OSError, they keep its errno and file names).
"""

from __future__ import annotations

import re

# Whole terminal escape sequences (CSI such as colours, OSC such as window titles), then any
# other C0/C1 control character, DEL included: library text (torch's) carries colour codes.
_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def one_line(text: str) -> str:
    """`text` as one printable line: escape sequences dropped, control characters and newlines become spaces."""
    return _CONTROL.sub(" ", _ESCAPE.sub("", text)).strip()


class MergeflowError(Exception):
    """Base of every error mergeflow raises on purpose; the CLI prints it as one line."""

    exit_code: int = 2
    retryable: bool = False
    # Whether rerunning the same command can succeed with the work kept so far (disk full, an
    # interruption): only then is the staging directory kept. A refusal of the input itself
    # cannot be resumed (a fixed input is a new export), so its staging is removed.
    resumable: bool = False

    def __init__(self, message: str, *, staging_dir: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.staging_dir = staging_dir

    def __str__(self) -> str:
        # Messages quote input (file names, config values): nothing from them reaches a terminal raw.
        return one_line(self.message)

    def __reduce__(self) -> tuple[object, ...]:
        # Prefect pickles a failed task's exception into its state: keep the declared fields, and
        # an OSError's errno and file names (restored by BaseException.__setstate__).
        state = {name: getattr(self, name) for name in ("errno", "filename", "filename2")} if isinstance(self, OSError) else None
        return (_rebuild, (type(self), self.message, self.staging_dir), state)

    def kept_in(self, staging_dir: str) -> MergeflowError:
        """This error, noting the staging directory kept for a resume; returns self for `raise`."""
        self.staging_dir = staging_dir
        return self


def _rebuild(cls: type[MergeflowError], message: str, staging_dir: str | None) -> MergeflowError:
    error = cls.__new__(cls)
    MergeflowError.__init__(error, message, staging_dir=staging_dir)
    return error


# -- the user's flags and paths ----------------------------------------------------------------

class UsageError(MergeflowError):
    """Flags or config values that cannot work together."""


class SigningKeyError(UsageError):
    """--sign-key / --verify-key: unreadable, not an elliptic-curve PEM key of the right kind, or not the signer's."""


class PathSafetyError(MergeflowError):
    """A path would escape its directory, overlap another input, or replace an existing one."""


class ConfinementError(PathSafetyError):
    """An event-driven run named a path or base model outside what the operator allowed at serve time."""


class TargetExistsError(PathSafetyError):
    """The target directory exists; mergeflow never overwrites."""


class ConcurrentExportError(MergeflowError):
    """Another export to the same target holds the lock."""


# -- the inputs --------------------------------------------------------------------------------

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


class InputChangedError(MergeflowError):
    """An input file changed while the export was reading it."""


# -- the output --------------------------------------------------------------------------------

class ExportInterruptedError(MergeflowError):
    """Ctrl-C or SIGTERM stopped the export; what was written is kept for a resume."""

    resumable = True

    exit_code = 130


class DiskFullError(MergeflowError, OSError):
    """The output filesystem ran out of space (or hit a file size limit) while writing."""

    resumable = True


class FileAccessError(MergeflowError, OSError):
    """The operating system refused access to a path: permission denied, or a read-only filesystem."""

    resumable = True


class StorageIOError(MergeflowError, OSError):
    """The disk or network filesystem failed (EIO, a stale handle): another attempt may succeed."""

    resumable = True

    retryable = True


class ArtifactInvalidError(MergeflowError):
    """An artifact (staged or published) fails validation.

    Not `ValidationError`: pydantic and huggingface_hub both export a class of that name.
    """

    resumable = True


# -- events and the Hub ------------------------------------------------------------------------

class EventError(MergeflowError):
    """The Prefect API cannot take an event or a run: none configured, unreachable, or credentials refused."""


class ApiAccessError(EventError):
    """The Prefect API refused this process's credentials (401/403): final, a retry gets the same answer."""


class UploadError(MergeflowError):
    """Uploading to or verifying on the Hugging Face Hub failed."""


class UploadAuthError(UploadError):
    """The Hub refused the credentials (401/403/404): retrying cannot help."""


class UploadTransientError(UploadError):
    """The Hub or the network kept failing with transient errors; a later retry may succeed."""

    retryable = True


class UploadVerificationError(UploadError):
    """The files on the Hub differ from the artifact's manifest after an upload."""


# -- the guard against a "merged" model that is its base -----------------------------------------

class UnchangedWeightsError(MergeflowError):
    """Every exported tensor equals the base's bit for bit; refused unless --allow-unchanged."""
