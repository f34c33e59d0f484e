"""What `test` checks on an artifact without its source: manifest, configs, file tree, hashes, weights.

The command line runs these checks in-process, and the validate flow runs them as a task: one
function, two entry points. Nothing here imports Prefect or torch (the whole `test` process
must start and finish in about a second), so records are only named for type checkers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import (
    MANIFEST_NAME,
    ManifestDocument,
    check_manifest,
    file_ranges_of,
)
from mergeflow.formats.seal import (
    PIN_NAME,
    SEAL_NAMES,
    SIGNATURE_NAME,
    check_pin,
    check_signed_files,
    read_signed_statement,
)
from mergeflow.hub.model_card import check_card
from mergeflow.io.fs import FileStamp
from mergeflow.io.jsonfiles import (
    JsonObject,
    dumps_canonical,
    parse_json_strict,
)
from mergeflow.io.ranges import FileRanges, verify_ranges
from mergeflow.io.session import sha256_file
from mergeflow.io.staging import artifact_root, is_staging_dir
from mergeflow.lora.artifact import (
    ADAPTER_DIR,
    ADAPTER_MANIFEST,
    adapter_only_root,
)
from mergeflow.outputs.registry import artifact_types, output_for_manifest

if TYPE_CHECKING:  # records pull in the rank-file loader (torch); `test` needs only their shape
    from mergeflow.records import VerifiedFile

# Below this size a file hashes in well under a millisecond: a pool would only add overhead.
PARALLEL_HASH_MIN_BYTES = 16 * 1024 * 1024
# More threads than cores on purpose: with shards of unequal size, one thread per big file lets the
# kernel share the cores until the last file ends, instead of one core idling on the biggest shard.
# hashlib releases the GIL for large updates, so the threads really run in parallel.
MAX_HASH_THREADS = max(8, 2 * (os.cpu_count() or 1))
# Ranges are equal slices of work, so one thread per core keeps every core busy to the end.
HASH_WORKERS = os.cpu_count() or 1


@dataclass(frozen=True)
class ArtifactSummary:
    architecture: str
    artifact_type: str
    files: int
    tensors: int
    manifest: ManifestDocument


class ArtifactCounts(TypedDict):
    """An ArtifactSummary without its manifest: what the validate-artifact task returns."""

    architecture: str
    artifact_type: str
    files: int
    tensors: int


class IntegrityResult(TypedDict):
    """`mergeflow test`'s JSON line, and the validate flow's result."""

    integrity: Literal["passed"]
    architecture: str
    signature: NotRequired[str]  # with --verify-key: "verified by <key fingerprint>"


def _tree_sizes(root: Path, folders: set[str] | None = None) -> dict[str, int]:
    """Size of every file under root by relative POSIX path; symlinks and special files are refused.

    `folders`, when given, collects every directory below root (relative POSIX paths).
    """
    found: dict[str, int] = {}
    pending = [root]
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                path = Path(entry.path)
                if entry.is_symlink():
                    raise ArtifactInvalidError(f"{path.relative_to(root)} is a symlink; artifacts hold plain files only")
                if entry.is_dir(follow_symlinks=False):
                    pending.append(path)
                    if folders is not None:
                        folders.add(path.relative_to(root).as_posix())
                elif entry.is_file(follow_symlinks=False):
                    found[path.relative_to(root).as_posix()] = entry.stat(follow_symlinks=False).st_size
                else:
                    raise ArtifactInvalidError(f"{path.relative_to(root)} is not a regular file")
    return found


def list_tree(root: Path) -> list[str]:
    """Every file under root as a relative POSIX path; symlinks and special files are refused."""
    return sorted(_tree_sizes(root))


def check_tree_and_hashes(root: Path, files: dict[str, str], *, verified: Mapping[str, VerifiedFile] | None = None,
                          sealed: bool = False, ranges: Mapping[str, FileRanges] | None = None) -> dict[str, str]:
    """The file tree equals the manifest's list exactly and every sha256 matches; returns the digests.

    `verified` (staged exports only) names files whose digest this export proved from their
    bytes: such a file is taken as read while its stamp is unchanged since; every other file,
    and every file of a published artifact, is hashed here. The manifest's pin lies beside it, unlisted;
    `sealed`: root is the artifact's top, where its signature lies too (mergeflow/formats/seal.py).
    `ranges`: the manifest's per-range digests; a file that has them is checked range by range, on
    every core, and its whole-file sha256 is then the manifest's (the export took both from the same bytes).
    """
    folders: set[str] = set()
    sizes = _tree_sizes(root, folders)
    sizes.pop(MANIFEST_NAME, None)
    for name in SEAL_NAMES if sealed else (PIN_NAME,):
        sizes.pop(name, None)
    present, listed = set(sizes), set(files)
    if present - listed:
        raise ArtifactInvalidError(f"{sorted(present - listed)[0]} is in the artifact but not in the manifest")
    if listed - present:
        raise ArtifactInvalidError(f"{sorted(listed - present)[0]} is listed in the manifest but missing")
    needed = {parent.as_posix() for name in listed for parent in PurePosixPath(name).parents if parent.name}
    if folders - needed:  # an empty (or emptied) directory is something the manifest does not describe
        raise ArtifactInvalidError(f"{sorted(folders - needed)[0]}/ is in the artifact but holds no file of the manifest")
    digests = {name: v.sha256 for name, v in (verified or {}).items() if name in listed and _unchanged(root / name, v)}
    ranged = {name: r for name, r in (ranges or {}).items() if name in listed - set(digests)}
    if ranged:
        digests.update(_check_ranges(root, ranged, {name: sizes[name] for name in listed - set(digests) - set(ranged)},
                                     sizes, files))
    else:
        digests.update(_hash_files(root, {name: sizes[name] for name in listed - set(digests)}))
    for name in sorted(listed):
        if digests[name] != files[name]:
            raise _damaged(name)
    return digests


def _damaged(name: str) -> ArtifactInvalidError:
    return ArtifactInvalidError(f"{name} does not match its sha256 in the manifest: the file was changed or damaged")


def _hash_files(root: Path, sizes: dict[str, int]) -> dict[str, str]:
    """sha256 of each named file: big ones in parallel threads (largest first), small ones here meanwhile."""
    big = sorted((n for n, s in sizes.items() if s >= PARALLEL_HASH_MIN_BYTES), key=lambda n: -sizes[n])
    small = sorted(set(sizes) - set(big))
    if len(big) < 2:  # nothing to overlap: threads would only add start-up cost
        return {name: sha256_file(root / name) for name in big + small}
    with ThreadPoolExecutor(max_workers=min(len(big), MAX_HASH_THREADS), thread_name_prefix="sha256") as pool:
        futures = {name: pool.submit(sha256_file, root / name) for name in big}
        digests = {name: sha256_file(root / name) for name in small}
        digests.update({name: future.result() for name, future in futures.items()})
    return digests


def _check_ranges(root: Path, ranged: Mapping[str, FileRanges], others: dict[str, int], sizes: Mapping[str, int],
                  files: Mapping[str, str]) -> dict[str, str]:
    """Every range of the ranged files, and the whole of the other big files, hashed on one thread per core.

    A file is as the manifest says when its size and every range match; its sha256 is then the
    manifest's. A file without ranges (small, or from an older manifest) is hashed whole.
    """
    for name, record in sorted(ranged.items()):
        if sizes[name] != record.size:
            raise _damaged(name)
    big = sorted((n for n, s in others.items() if s >= PARALLEL_HASH_MIN_BYTES), key=lambda n: -others[n])
    fds: dict[str, int] = {}
    try:
        for name in ranged:
            fds[name] = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW)
        whole = [(name, partial(sha256_file, root / name)) for name in big]
        failed, digests = verify_ranges(fds, dict(ranged), HASH_WORKERS, whole)
    finally:
        for fd in fds.values():
            os.close(fd)
    if failed:
        raise _damaged(min(failed))
    digests.update({name: sha256_file(root / name) for name in sorted(set(others) - set(big))})
    digests.update({name: files[name] for name in ranged})  # proven range by range
    return digests


def _unchanged(path: Path, verified: VerifiedFile) -> bool:
    try:
        return FileStamp.of(path) == verified.stamp
    except FileNotFoundError:
        return False


def manifest_relpath(root: Path) -> str:
    """Where an artifact's manifest is: at its root, or in lora_adapter/ for a LoRA-only adapter export."""
    return ADAPTER_MANIFEST if adapter_only_root(root) is not None else MANIFEST_NAME


def read_canonical_manifest(path: Path) -> JsonObject:
    """The manifest, whose bytes must be exactly its canonical JSON (as mergeflow writes it).

    A byte the manifest's parser would forgive (appended whitespace, reordered keys, another
    number format) is still an edit of the record this artifact is proven against.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ArtifactInvalidError(f"{MANIFEST_NAME} cannot be read ({type(exc).__name__}: {exc})") from None
    data = parse_json_strict(raw, ArtifactInvalidError, MANIFEST_NAME)
    if not isinstance(data, dict):
        raise ArtifactInvalidError(f"{MANIFEST_NAME} is not a JSON object")
    if raw != dumps_canonical(data).encode("utf-8"):
        raise ArtifactInvalidError(f"{MANIFEST_NAME} is not byte for byte the canonical JSON mergeflow wrote: "
                                   "it was edited after the export")
    return data


def validate_artifact_dir(root: Path, verified: Mapping[str, VerifiedFile] | None = None, *,
                          top: bool = True, published: bool | None = None) -> ArtifactSummary:
    """Everything `test` checks, without the source checkpoint (`verified`: see check_tree_and_hashes).

    `top`: root holds the artifact's own manifest (not an adapter nested in a model export, whose
    manifest the outer one lists), so its pin is checked, and its signature's statement when signed.
    `published`: the pin is required (default: unless root is the artifact inside a staging dir).
    """
    if not root.is_dir():
        raise ArtifactInvalidError(f"{root} is not a directory")
    if published is None:
        published = not is_staging_dir(root.parent)
    adapter_only = adapter_only_root(root)
    if adapter_only is not None:
        return validate_artifact_dir(adapter_only, _below(verified, adapter_only.relative_to(root).as_posix()), top=top,
                                     published=published)
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise ArtifactInvalidError(f"{root.name} has no {MANIFEST_NAME}; is it a mergeflow artifact?")
    manifest = check_manifest(read_canonical_manifest(manifest_path), artifact_types())
    digests = check_tree_and_hashes(root, manifest["files"], verified=verified, sealed=top, ranges=file_ranges_of(manifest))
    output = output_for_manifest(manifest)  # the kind of artifact: its own configs and weights are checked
    output.check_configs(root, manifest)
    count = output.check_weights(root, manifest)
    check_card(root, manifest.get("model_card"), manifest["tensors"])  # the card (hashed above) names these tensors
    if ADAPTER_MANIFEST in manifest["files"]:  # an exported adapter beside the model: an artifact of its own
        inner = validate_artifact_dir(root / ADAPTER_DIR, _below(verified, ADAPTER_DIR), top=False)
        if output_for_manifest(inner.manifest).nested_dir != ADAPTER_DIR:
            raise ArtifactInvalidError(f"{ADAPTER_DIR}/ holds an artifact that is not a peft_adapter")
    if top:  # last: every check above names the defect itself; these catch an edit that passes them all
        check_seal(root, digests, published=published)
    else:  # an adapter beside a model: the model's manifest lists its pin, checked here against its manifest
        check_pin(root, sha256_file(manifest_path), required=False)
    return ArtifactSummary(manifest["architecture"], manifest["artifact_type"], len(manifest["files"]) + 1, count, manifest)


def check_seal(home: Path, digests: dict[str, str], *, published: bool) -> str | None:
    """The pin names the manifest's digest (required once published); a signature's statement covers exactly
    these files, manifest and pin included. Returns the signing key's fingerprint, None when unsigned.

    This reads the signature's statement, not its cryptographic signature: without the public key it
    catches an edit that left model.sig alone; `--verify-key` (mergeflow/signing.py) checks the signature.
    """
    manifest_sha256 = sha256_file(home / MANIFEST_NAME)
    check_pin(home, manifest_sha256, required=published)
    signature = home / SIGNATURE_NAME
    # In staging, a signature is an earlier attempt's, which the seal step replaces: not this export's yet.
    if not published or not (signature.exists() or signature.is_symlink()):
        return None
    statement = read_signed_statement(signature)
    covered = {**digests, MANIFEST_NAME: manifest_sha256}
    if (home / PIN_NAME).is_file():
        covered[PIN_NAME] = sha256_file(home / PIN_NAME)
    for name in statement.ignored:
        if name != SIGNATURE_NAME and name not in GIT_PATHS:
            raise ArtifactInvalidError(f"{SIGNATURE_NAME} leaves {name} out of the signature; mergeflow signs every file")
    check_signed_files(statement, {n: d for n, d in covered.items() if not _ignored_by_signing(n)})
    return statement.key_fingerprint


# What model_signing leaves out of every signature by default (its verifier does too): the artifact
# still lists such a file in the manifest, so `test` checks it there.
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")


def _ignored_by_signing(name: str) -> bool:
    return any(name == p or name.startswith(f"{p}/") for p in GIT_PATHS)


def _below(verified: Mapping[str, VerifiedFile] | None, prefix: str) -> dict[str, VerifiedFile] | None:
    """The entries of `verified` inside directory `prefix`, relative to it."""
    if not verified:
        return None
    return {name.removeprefix(f"{prefix}/"): v for name, v in verified.items() if name.startswith(f"{prefix}/")}


def artifact_to_check(test_hf_dir: str | Path) -> Path:
    """The directory `test` validates: the artifact itself, or the one staged in a failed merge's kept staging dir.

    A merge that failed before its metadata step staged shards but no manifest: there is no
    artifact to validate yet, and the refusal says so instead of "artifact has no manifest".
    """
    path = Path(test_hf_dir).expanduser().resolve()
    root = artifact_root(path)
    if is_staging_dir(path) and not (root / MANIFEST_NAME).is_file() and adapter_only_root(root) is None:
        raise ArtifactInvalidError(f"{path.name} is the staging dir of a merge that failed before writing its manifest: "
                                   "nothing to validate yet; rerun the same merge to resume it")
    return root


def check_artifact(test_hf_dir: str | Path, verify_key: str | Path | None = None) -> IntegrityResult:
    """`mergeflow test`: every check above on the artifact at test_hf_dir, as the one-line JSON result.

    `verify_key`: an elliptic-curve public key (PEM); the artifact must carry model.sig signed by its
    private key, and the OMS verifier must accept every file (mergeflow/signing.py).
    """
    root = artifact_to_check(test_hf_dir)
    if verify_key is not None:  # the key first: a bad key is a refusal of the flag, before any hashing
        from mergeflow.signing import load_verify_key

        load_verify_key(verify_key)
    summary = validate_artifact_dir(root)
    result: IntegrityResult = {"integrity": "passed", "architecture": summary.architecture}
    if verify_key is not None:
        from mergeflow.signing import verify_artifact

        result["signature"] = verify_artifact(root, verify_key)
    return result
