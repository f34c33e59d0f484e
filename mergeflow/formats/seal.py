"""The two records beside an artifact's manifest that the manifest cannot list: its pin and its signature.

The manifest lists every file's sha256, so no listed file can carry the manifest's own digest (it
would change the manifest, whose digest it carries). The pin is therefore a record the manifest
does not hash: `merge_manifest.sha256`, one line in `sha256sum`'s format, so `sha256sum -c` checks
it too. It catches an edit of the manifest alone (a producer, a digest, a tensor rewritten, even in
canonical form); whoever rewrites manifest and pin together forges an unsigned artifact, which only
the signature stops.

The signature, `model.sig`, is an OpenSSF model-signing (OMS) bundle: a DSSE envelope around an
in-toto statement whose predicate lists every file's sha256, manifest and pin included. This module
reads that statement without any cryptography, so `test` cross-checks it against the files even
without the public key; `mergeflow/signing.py` checks the signature itself.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import MANIFEST_NAME
from mergeflow.io.jsonfiles import write_bytes_durable

PIN_NAME = "merge_manifest.sha256"
SIGNATURE_NAME = "model.sig"
# Neither is listed in the manifest; both lie beside it (in lora_adapter/ for a LoRA-only export).
SEAL_NAMES = (PIN_NAME, SIGNATURE_NAME)
_PIN_LINE = re.compile(rf"([0-9a-f]{{64}})  {re.escape(MANIFEST_NAME)}\n")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The bundle model_signing's key signer writes (sigstore bundle v0.3, in-toto statement v1, predicate v1.0).
_BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
_PREDICATE_TYPE = "https://model_signing/signature/v1.0"
_MAX_SIGNATURE_BYTES = 64 * 1024 * 1024  # a statement of a million files stays far below


def pin_text(manifest_sha256: str) -> bytes:
    """The pin's bytes: `<sha256>  merge_manifest.json`, as `sha256sum` writes it."""
    return f"{manifest_sha256}  {MANIFEST_NAME}\n".encode()


def write_pin(home: Path, manifest_sha256: str) -> None:
    """Pin the manifest at `home` (durably: a resume finds the old pin or the new one, never half of one)."""
    write_bytes_durable(home / PIN_NAME, pin_text(manifest_sha256))


def check_pin(home: Path, manifest_sha256: str, *, required: bool) -> None:
    """The pin beside the manifest names exactly the manifest's digest (`required`: a published artifact)."""
    path = home / PIN_NAME
    if path.is_symlink() or not path.exists():
        if required:
            raise ArtifactInvalidError(f"{PIN_NAME} is missing: nothing pins {MANIFEST_NAME}, so an edit of it cannot be "
                                       "told from the export; export it again (every export is pinned when published)")
        return
    if not path.is_file():
        raise ArtifactInvalidError(f"{PIN_NAME} is not a regular file")
    match = _PIN_LINE.fullmatch(path.read_bytes().decode("utf-8", "replace"))
    if match is None:
        raise ArtifactInvalidError(f"{PIN_NAME} is not one line `<sha256>  {MANIFEST_NAME}`: it was edited")
    if match.group(1) != manifest_sha256:
        raise ArtifactInvalidError(f"{MANIFEST_NAME} does not match the digest {PIN_NAME} pins: the manifest was "
                                   "edited after the export")


@dataclass(frozen=True)
class SignedStatement:
    """What an OMS bundle claims, read without checking its signature."""

    key_fingerprint: str  # the bundle's public-key hint: sha256 of the signer's public key (SubjectPublicKeyInfo PEM)
    files: dict[str, str]  # relative POSIX path -> sha256 hex, every file the signature covers
    ignored: tuple[str, ...]  # the paths the signer left out (model.sig itself, git's files)


def read_signed_statement(path: Path) -> SignedStatement:
    """Parse `model.sig` into the statement it signs; anything else than a key-signed OMS bundle is refused."""
    if path.is_symlink() or not path.is_file():
        raise ArtifactInvalidError(f"{SIGNATURE_NAME} is not a regular file")
    if path.stat().st_size > _MAX_SIGNATURE_BYTES:
        raise ArtifactInvalidError(f"{SIGNATURE_NAME} is too large to be an OMS signature bundle")
    what = f"{SIGNATURE_NAME} is not an OpenSSF model-signing bundle signed with a key"
    try:
        bundle = json.loads(path.read_bytes())
        if bundle.get("mediaType") != _BUNDLE_MEDIA_TYPE:
            raise ArtifactInvalidError(f"{what} (media type {str(bundle.get('mediaType'))[:80]!r})")
        hint = bundle["verificationMaterial"]["publicKey"]["hint"]
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True))
        predicate = statement["predicate"]
        serialization = predicate["serialization"]
        if statement.get("predicateType") != _PREDICATE_TYPE or serialization.get("method") != "files" \
                or serialization.get("hash_type") != "sha256":
            raise ArtifactInvalidError(f"{what} by whole files with sha256 (as mergeflow signs)")
        files: dict[str, str] = {}
        for resource in predicate["resources"]:
            name, digest = resource["name"], resource["digest"]
            if resource.get("algorithm") != "sha256" or not isinstance(name, str) or not isinstance(digest, str) \
                    or not _SHA256.fullmatch(digest) or name in files:
                raise ArtifactInvalidError(f"{what}: a resource is not a unique file with its sha256")
            files[name] = digest
        ignored = tuple(str(p) for p in serialization.get("ignore_paths", []))
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error, RecursionError):
        raise ArtifactInvalidError(what) from None
    if not isinstance(hint, str) or not _SHA256.fullmatch(hint):
        raise ArtifactInvalidError(f"{what}: it names no public key")
    return SignedStatement(key_fingerprint=hint, files=files, ignored=ignored)


def check_signed_files(statement: SignedStatement, digests: dict[str, str]) -> None:
    """The statement's files are exactly `digests` (the artifact's files, manifest and pin included): one line naming the file."""
    for name in sorted(set(digests) | set(statement.files)):
        if name not in statement.files:
            raise ArtifactInvalidError(f"{name} is not covered by {SIGNATURE_NAME}: it was added after signing")
        if name not in digests:
            raise ArtifactInvalidError(f"{name} is signed in {SIGNATURE_NAME} but missing from the artifact")
        if statement.files[name] != digests[name]:
            raise ArtifactInvalidError(f"{name} does not match its sha256 in {SIGNATURE_NAME}: the file was changed "
                                       "after signing")
