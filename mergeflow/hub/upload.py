"""Upload a published artifact to the Hugging Face Hub and verify that the Hub holds exactly it.

An artifact is a directory with `merge_manifest.json` at its root whose `files` maps every
other file (relative POSIX path) to its sha256. The upload is one commit that makes the repo
equal to the artifact: the manifest's files plus the manifest, files the manifest does not
list are deleted, and nothing else from the directory is sent. Verification then compares
the commit's file list with the manifest, LFS/Xet files by size and sha256, small files by
downloading and hashing them. The local artifact is only ever read.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.hf_api import CommitInfo, RepoFile

from mergeflow.config import UploadSummary
from mergeflow.errors import (
    ArtifactInvalidError,
    PathSafetyError,
    UploadError,
    UploadVerificationError,
)
from mergeflow.formats.manifest import MANIFEST_NAME
from mergeflow.formats.seal import SEAL_NAMES
from mergeflow.hub.retry import call_with_retries
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.io.paths import check_relative_name
from mergeflow.io.session import sha256_file
from mergeflow.lora.artifact import adapter_only_root

logger = logging.getLogger(__name__)

# The Hub writes .gitattributes into every new repo; it is the Hub's, not the artifact's.
HUB_MANAGED_FILES = frozenset({".gitattributes"})
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LIST_LIMIT = 5  # file names quoted per kind of difference in an error message


@dataclass(frozen=True)
class UploadRecord:
    """What was uploaded and verified: repo, exact commit, size of the verified content, visibility."""

    repo_id: str
    commit_sha: str
    url: str
    files_verified: int
    bytes_verified: int
    private: bool

    def to_dict(self) -> UploadSummary:
        """The record as a JSON-serialisable dict."""
        return UploadSummary(**asdict(self))


@dataclass(frozen=True)
class ArtifactFiles:
    """The files an artifact publishes: relative path -> (sha256, size), the manifest included."""

    root: Path
    expected: dict[str, tuple[str, int]]
    commit_title: str

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.expected.values())


def _is_safe_relative(path: str) -> bool:
    try:
        check_relative_name(path, MANIFEST_NAME)
    except PathSafetyError:
        return False
    return True


def read_artifact_files(artifact_dir: Path) -> ArtifactFiles:
    """Read the manifest and check cheaply (no hashing of listed files) that every listed file is there."""
    root = Path(artifact_dir)
    if not root.is_dir():
        raise UploadError(f"Cannot upload {root}: it is not a directory.")
    try:  # a LoRA-only adapter export publishes lora_adapter/ alone: that directory is the artifact (and the repo)
        root = adapter_only_root(root) or root
    except ArtifactInvalidError as exc:
        raise UploadError(f"Cannot upload {root}: {exc}") from None
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise UploadError(f"Cannot upload {root}: {MANIFEST_NAME} is missing; only published mergeflow artifacts can be uploaded.")
    manifest = read_json_strict(manifest_path, UploadError, f"Cannot upload {root}: {MANIFEST_NAME}")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise UploadError(f"Cannot upload {root}: {MANIFEST_NAME} has no `files` table.")
    real_root = root.resolve()
    expected: dict[str, tuple[str, int]] = {}
    for rel, digest in sorted(files.items()):
        if not isinstance(rel, str) or not _is_safe_relative(rel) or rel == MANIFEST_NAME:
            raise UploadError(f"Cannot upload {root}: {MANIFEST_NAME} lists an unsafe path {rel!r}.")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise UploadError(f"Cannot upload {root}: {MANIFEST_NAME} has no valid sha256 for {rel}.")
        local = root / rel
        if local.is_symlink() or not local.is_file() or not local.resolve().is_relative_to(real_root):
            raise UploadError(
                f"Cannot upload {root}: {rel} is listed in {MANIFEST_NAME} but is not a regular file inside the "
                "artifact; check the artifact with `mergeflow test --test_hf_dir` and export it again."
            )
        expected[rel] = (digest, local.stat().st_size)
    expected[MANIFEST_NAME] = (sha256_file(manifest_path), manifest_path.stat().st_size)
    for name in SEAL_NAMES:  # the manifest's pin and the signature: unlisted (they cover the manifest), uploaded too
        local = root / name
        if local.is_symlink() or (local.exists() and not local.is_file()):
            raise UploadError(f"Cannot upload {root}: {name} is not a regular file; check the artifact with `mergeflow test`.")
        if local.is_file():
            expected[name] = (sha256_file(local), local.stat().st_size)
    architecture = manifest.get("architecture")
    title = f"Upload mergeflow artifact ({architecture})" if isinstance(architecture, str) else "Upload mergeflow artifact"
    return ArtifactFiles(root=root, expected=expected, commit_title=title)


def _hub_api(token: str | None, endpoint: str | None) -> HfApi:
    # HF_ENDPOINT is read here, at call time: huggingface_hub freezes it into a constant at import.
    return HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token, library_name="mergeflow")


def _public_url(endpoint: str, repo_id: str) -> str:
    parts = urlsplit(endpoint)
    host = parts.netloc.rsplit("@", 1)[-1]  # never echo credentials embedded in an endpoint URL
    return urlunsplit((parts.scheme, host, f"{parts.path.rstrip('/')}/{repo_id}", "", ""))


def _retrier(repo_id: str, token: str | None, max_attempts: int, base_delay: float) -> Callable[..., Any]:
    secrets = (token, get_token(), os.environ.get("HF_TOKEN"))
    return functools.partial(call_with_retries, repo_id=repo_id, secrets=secrets, max_attempts=max_attempts, base_delay=base_delay)


def _commit_artifact(api: HfApi, repo_id: str, artifact: ArtifactFiles) -> CommitInfo:
    """One commit that makes the repo equal to the artifact; rerunnable: unchanged files are skipped."""
    info = api.repo_info(repo_id)  # the head and its files, read again on every attempt
    remote = {s.rfilename for s in info.siblings or []}
    stale = sorted(remote - artifact.expected.keys() - HUB_MANAGED_FILES)
    if stale:
        logger.info("Removing %d file(s) from %s that the manifest does not list: %s", len(stale), repo_id, ", ".join(stale[:_LIST_LIMIT]))
    operations: list[CommitOperationAdd | CommitOperationDelete] = [CommitOperationDelete(path_in_repo=p) for p in stale]
    operations += [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(artifact.root / p)) for p in sorted(artifact.expected)]
    # parent_commit makes the Hub refuse the commit if someone else committed since we listed the repo.
    return api.create_commit(repo_id, operations, commit_message=artifact.commit_title, parent_commit=info.sha)


def _names(paths: list[str]) -> str:
    shown = ", ".join(paths[:_LIST_LIMIT])
    return shown + (f" and {len(paths) - _LIST_LIMIT} more" if len(paths) > _LIST_LIMIT else "")


def _verify(api: HfApi, artifact: ArtifactFiles, repo_id: str, revision: str | None, retry: Callable[..., Any]) -> UploadRecord:
    info = retry(lambda: api.repo_info(repo_id, revision=revision), what="Reading the repo info")
    sha = info.sha
    entries = retry(lambda: list(api.list_repo_tree(repo_id, recursive=True, revision=sha)), what="Listing the uploaded files")
    remote = {e.path: e for e in entries if isinstance(e, RepoFile)}
    expected = artifact.expected
    missing = sorted(expected.keys() - remote.keys())
    unexpected = sorted(remote.keys() - expected.keys() - HUB_MANAGED_FILES)
    differing: list[str] = []
    to_download: list[str] = []
    for path in sorted(expected.keys() & remote.keys()):
        digest, size = expected[path]
        entry = remote[path]
        if entry.size != size:
            differing.append(f"{path} (size {entry.size} on the Hub, {size} here)")
        elif entry.lfs is not None:
            if entry.lfs.sha256 != digest or entry.lfs.size != size:
                differing.append(f"{path} (sha256 {entry.lfs.sha256[:12]}... on the Hub, {digest[:12]}... in the manifest)")
        else:
            to_download.append(path)  # regular git files carry no sha256: check their content itself
    if to_download:
        with tempfile.TemporaryDirectory(prefix="mergeflow-verify-") as cache:
            for path in to_download:
                local = retry(lambda p=path: api.hf_hub_download(repo_id, p, revision=sha, cache_dir=cache), what=f"Downloading {path} to verify it")
                got = sha256_file(Path(local))
                if got != expected[path][0]:
                    differing.append(f"{path} (content sha256 {got[:12]}... on the Hub, {expected[path][0][:12]}... in the manifest)")
    if missing or unexpected or differing:
        kinds = [
            f"missing on the Hub: {_names(missing)}" if missing else "",
            f"on the Hub but not in the manifest: {_names(unexpected)}" if unexpected else "",
            f"content differs: {_names(differing)}" if differing else "",
        ]
        raise UploadVerificationError(
            f"The Hub copy of {repo_id} at commit {sha} differs from the artifact {artifact.root}: "
            + "; ".join(k for k in kinds if k)
            + f". The local artifact is untouched. Upload it again (`mergeflow upload --test_hf_dir {artifact.root} "
            f"--hf_upload_path {repo_id}`); if the same files differ again, check the local copy with `mergeflow test "
            f"--test_hf_dir {artifact.root}`."
        )
    logger.info("Verified %d file(s), %d bytes, on %s at commit %s", len(expected), artifact.total_bytes, repo_id, sha)
    return UploadRecord(
        repo_id=repo_id,
        commit_sha=sha,
        url=_public_url(api.endpoint, repo_id),
        files_verified=len(expected),
        bytes_verified=artifact.total_bytes,
        private=bool(info.private),
    )


def verify_upload(
    artifact_dir: Path,
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    max_attempts: int = 5,
    base_delay: float = 1.0,
) -> UploadRecord:
    """Check that the repo at `revision` (default: the main branch head) holds exactly the artifact."""
    artifact = read_artifact_files(Path(artifact_dir))
    api = _hub_api(token, endpoint)
    return _verify(api, artifact, repo_id, revision, _retrier(repo_id, token, max_attempts, base_delay))


def upload_artifact(
    artifact_dir: Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    max_attempts: int = 5,
    base_delay: float = 1.0,
) -> UploadRecord:
    """Create the repo if needed, commit the artifact's manifest files and manifest, then verify the commit."""
    artifact = read_artifact_files(Path(artifact_dir))
    api = _hub_api(token, endpoint)
    retry = _retrier(repo_id, token, max_attempts, base_delay)
    retry(lambda: api.create_repo(repo_id, private=private, exist_ok=True), what="Creating the repo")
    if private:
        # create_repo ignores `private` for an existing repo: never put a private export into a public repo.
        info = retry(lambda: api.repo_info(repo_id), what="Reading the repo info")
        if not info.private:
            raise UploadError(
                f"{repo_id} already exists and is public, but a private upload was requested: make the repo private "
                "on the Hub (Settings) or choose another --hf_upload_path. Nothing was uploaded."
            )
    logger.info("Uploading %d file(s), %d bytes, from %s to %s", len(artifact.expected), artifact.total_bytes, artifact.root, repo_id)
    commit = retry(lambda: _commit_artifact(api, repo_id, artifact), what="Uploading the artifact")
    logger.info("Committed %s as %s; verifying", repo_id, commit.oid)
    return _verify(api, artifact, repo_id, commit.oid, retry)


__all__ = ["MANIFEST_NAME", "ArtifactFiles", "UploadRecord", "read_artifact_files", "upload_artifact", "verify_upload"]
