"""Signing an artifact with an offline elliptic-curve key, in the OpenSSF model-signing (OMS) format.

The signature is the bundle `model_signing sign key` writes and `model_signing verify key` checks:
`model.sig` beside the artifact's manifest, covering every file of the artifact (manifest and pin
included; model_signing leaves out only the signature itself and git's files). mergeflow signs
through the `model-signing` package's own API (the optional extra `sign`), so the standard tool
verifies it as it verifies its own signatures. Keys are read here first, with cryptography, so a
wrong key is one line before any work: model_signing would raise deep inside the signing step.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.errors import ArtifactInvalidError, SigningKeyError
from mergeflow.formats.seal import SIGNATURE_NAME, read_signed_statement

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import (
        EllipticCurvePrivateKey,
        EllipticCurvePublicKey,
    )

# The curves model_signing's key signer accepts (its _check_supported_ec_key).
SUPPORTED_CURVES = ("secp256r1", "secp384r1", "secp521r1")
_MAX_KEY_BYTES = 1024 * 1024
_INSTALL = "install the signing extra: pip install 'mergeflow[sign]'"


def _read_key(path: str | Path, flag: str) -> bytes:
    key = Path(path).expanduser()
    try:
        if not key.is_file():
            raise SigningKeyError(f"{flag} {key} is not a file (a PEM key is expected)")
        if key.stat().st_size > _MAX_KEY_BYTES:
            raise SigningKeyError(f"{flag} {key} is too large to be a PEM key")
        return key.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"{flag} {key} cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None


def _kind(key: object) -> str:
    """A key's algorithm, as a user names it (RSA, Ed25519, ...)."""
    name = type(key).__name__.lstrip("_")
    for suffix in ("PrivateKey", "PublicKey"):
        name = name.removesuffix(suffix)
    return name.upper() if name.lower() in ("rsa", "dsa", "dh") else name


def key_fingerprint(public_key: EllipticCurvePublicKey) -> str:
    """sha256 of the key's SubjectPublicKeyInfo PEM: the hint model_signing writes into the bundle."""
    from cryptography.hazmat.primitives import serialization

    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def load_signing_key(path: str | Path) -> EllipticCurvePrivateKey:
    """The --sign-key: an unencrypted elliptic-curve private key (P-256, P-384 or P-521) in PEM; else one line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    raw = _read_key(path, "--sign-key")
    try:
        key: Any = serialization.load_pem_private_key(raw, password=None)
    except TypeError:  # "Password was not given but private key is encrypted"
        raise SigningKeyError(f"--sign-key {path} is encrypted; give an unencrypted elliptic-curve key "
                              "(keep it offline: only the signing step reads it)") from None
    except (ValueError, UnicodeError):
        try:
            serialization.load_pem_public_key(raw)
        except (ValueError, UnicodeError):
            raise SigningKeyError(f"--sign-key {path} is not a PEM private key") from None
        raise SigningKeyError(f"--sign-key {path} is a public key; signing needs its private key "
                              "(the public one is for --verify-key)") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SigningKeyError(f"--sign-key {path} is an {_kind(key)} key; OpenSSF model signing takes an "
                              f"elliptic-curve key ({', '.join(SUPPORTED_CURVES)})")
    if key.curve.name not in SUPPORTED_CURVES:
        raise SigningKeyError(f"--sign-key {path} is on curve {key.curve.name}; OpenSSF model signing takes "
                              f"{', '.join(SUPPORTED_CURVES)}")
    return key


def load_verify_key(path: str | Path) -> EllipticCurvePublicKey:
    """The --verify-key: an elliptic-curve public key in PEM; else one line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    raw = _read_key(path, "--verify-key")
    try:
        key: Any = serialization.load_pem_public_key(raw)
    except (ValueError, UnicodeError):
        private = b"PRIVATE KEY-----" in raw
        raise SigningKeyError(f"--verify-key {path} is a private key; pass its public key (keep the private one "
                              "offline)" if private else f"--verify-key {path} is not a PEM public key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise SigningKeyError(f"--verify-key {path} is an {_kind(key)} key; OpenSSF model signatures are verified "
                              f"with an elliptic-curve key ({', '.join(SUPPORTED_CURVES)})")
    if key.curve.name not in SUPPORTED_CURVES:
        raise SigningKeyError(f"--verify-key {path} is on curve {key.curve.name}; expected {', '.join(SUPPORTED_CURVES)}")
    return key


def _model_signing() -> Any:
    try:
        import model_signing
    except ImportError as exc:  # the extra is optional: only signing and --verify-key need it
        raise SigningKeyError(f"signing needs the model-signing package ({exc.name or exc} is missing); {_INSTALL}") from None
    return model_signing


def _hashing_named(model_signing: Any, name: str) -> Any:
    """model_signing's default hashing (whole files, sha256, git's files left out), with the signature left out
    too, and the statement's subject named after the published artifact instead of its staging directory."""

    class _Named(model_signing.hashing.Config):  # type: ignore[misc, name-defined]
        def hash(self, model_path: Any, *, files_to_hash: Any = None) -> Any:
            hashed = super().hash(model_path, files_to_hash=files_to_hash)
            # Manifest(model_name, items, serialization): the name is informative only (model_signing's docs).
            return model_signing.manifest.Manifest(name, [_item(model_signing, rd) for rd in hashed.resource_descriptors()],
                                                   hashed._serialization_type)

    return _Named().set_ignored_paths(paths=[SIGNATURE_NAME])


def _item(model_signing: Any, descriptor: Any) -> Any:
    return model_signing.manifest.FileManifestItem(path=Path(descriptor.identifier), digest=descriptor.digest)


def sign_artifact(home: Path, key_path: str | Path, name: str, work_dir: Path | None = None) -> str:
    """Write `home/model.sig` over every file in `home`, durably; returns the signing key's fingerprint.

    `name`: the published artifact's directory name (the signed statement's subject). `work_dir`
    (outside `home`, same filesystem): where the bundle is written before its rename, so a kill
    mid-write never leaves half a signature in the artifact.
    """
    key = load_signing_key(key_path)
    model_signing = _model_signing()
    signature = home / SIGNATURE_NAME
    signature.unlink(missing_ok=True)  # an earlier attempt's, over files that may have changed since
    written = (work_dir / f"{SIGNATURE_NAME}.partial") if work_dir is not None else signature
    try:
        (model_signing.signing.Config().use_elliptic_key_signer(private_key=Path(key_path).expanduser())
         .set_hashing_config(_hashing_named(model_signing, name)).sign(home, written))
    except ValueError as exc:  # a symlink or special file in the tree; validation refuses those first
        raise ArtifactInvalidError(f"signing {name} failed: {exc}") from None
    with open(written, "rb") as handle:  # durable before the publish rename makes it visible
        os.fsync(handle.fileno())
    if written != signature:
        os.replace(written, signature)
    return key_fingerprint(key.public_key())


def verify_artifact(home: Path, verify_key: str | Path) -> str:
    """`test --verify-key`: model.sig is signed by this key and model_signing's verifier accepts every file.

    Returns "verified by <fingerprint>". Each failure is one line naming the file (or the key).
    """
    from mergeflow.lora.artifact import adapter_only_root

    home = adapter_only_root(home) or home
    key = load_verify_key(verify_key)
    signature = home / SIGNATURE_NAME
    if not (signature.exists() or signature.is_symlink()):
        raise ArtifactInvalidError(f"{SIGNATURE_NAME} is missing: the artifact is not signed (or its signature was removed)")
    statement = read_signed_statement(signature)
    fingerprint = key_fingerprint(key)
    if statement.key_fingerprint != fingerprint:
        raise SigningKeyError(f"--verify-key {verify_key} does not match the key that signed {SIGNATURE_NAME} "
                              f"(signed by key {statement.key_fingerprint[:16]}..., given {fingerprint[:16]}...)")
    model_signing = _model_signing()
    config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=Path(verify_key).expanduser())
    config.set_hashing_config(model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME]))
    try:
        config.verify(home, signature)
    except ValueError as exc:  # a file differs: name it, in one line (model_signing lists raw digests)
        raise ArtifactInvalidError(_mismatch_line(exc)) from None
    except Exception as exc:  # cryptography's InvalidSignature: the statement was edited after signing
        if type(exc).__name__ == "InvalidSignature":
            raise ArtifactInvalidError(f"{SIGNATURE_NAME}'s signature does not verify with --verify-key: the signed "
                                       "statement was edited") from None
        raise
    return f"verified by {fingerprint}"


# model_signing's mismatch report (verifying.Config._get_manifest_diff), each kind with the one line mergeflow says.
_MISMATCHES = (
    (r"Hash mismatch for '([^']+)'", "{} does not match its sha256 in {sig}: the file was changed after signing"),
    (r"Extra files found in model '[^']*': ([^,\]'\"]+)", "{} is not covered by {sig}: it was added after signing"),
    (r"Missing files in model '[^']*': ([^,\]'\"]+)", "{} is signed in {sig} but missing from the artifact"),
)


def _mismatch_line(exc: ValueError) -> str:
    """model_signing's mismatch report as one line naming the first file."""
    text = str(exc)
    for pattern, line in _MISMATCHES:
        match = re.search(pattern, text)
        if match:
            return line.format(match.group(1).strip(), sig=SIGNATURE_NAME)
    return f"{SIGNATURE_NAME} does not verify: {text[:300]}"
