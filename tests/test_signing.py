"""Sealed artifacts: the manifest's pin (every export) and the OpenSSF model signature (--sign-key).

Two real tiny exports per worker (module fixtures), one signed and one not, each through the command
line in its own process; every test edits a copy. The standard verifier (`python -m model_signing
verify key`) runs as a separate process; keys are generated here with `cryptography`.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forked_cli
import pytest
from builders import make_export
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from mergeflow.errors import (
    ArtifactInvalidError,
    ExportInterruptedError,
    SigningKeyError,
)
from mergeflow.export.check.artifact_check import check_artifact, list_tree
from mergeflow.formats.manifest import MANIFEST_NAME
from mergeflow.formats.seal import PIN_NAME, SIGNATURE_NAME, read_signed_statement
from mergeflow.io.jsonfiles import dumps_canonical
from mergeflow.io.session import sha256_file
from mergeflow.signing import key_fingerprint, sign_artifact

WEIGHTS = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class Keys:
    signer: Path  # EC P-256 private key (PKCS#8 PEM), what `model_signing sign key` takes
    signer_pub: Path
    other: Path  # another EC key (P-384)
    other_pub: Path
    rsa: Path
    rsa_pub: Path
    random: Path
    encrypted: Path
    fingerprint: str  # the signer's


def _write_private(path: Path, key: Any, password: bytes | None = None) -> Path:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return path


def _write_public(path: Path, key: Any) -> Path:
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    d = tmp_path_factory.mktemp("keys")
    signer, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP384R1())
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "random.bin").write_bytes(bytes(range(256)) * 4)
    return Keys(signer=_write_private(d / "signer.pem", signer), signer_pub=_write_public(d / "signer.pub", signer),
                other=_write_private(d / "other.pem", other), other_pub=_write_public(d / "other.pub", other),
                rsa=_write_private(d / "rsa.pem", rsa_key), rsa_pub=_write_public(d / "rsa.pub", rsa_key),
                random=d / "random.bin", encrypted=_write_private(d / "encrypted.pem", signer, b"secret"),
                fingerprint=key_fingerprint(signer.public_key()))


@pytest.fixture(scope="module")
def env(prefect_server: Any) -> dict[str, str]:
    return {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_export(tmp_path_factory.mktemp("ckpt"), "FluxTransformer2DModel", 2)


def _merge_args(ex: Any, target: Path, *extra: str) -> list[str]:
    return ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--target_dir", str(target),
            "--base_model", str(ex.base_dir), "--output_format", "transformer", *extra]


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return forked_cli.mergeflow(args, env, timeout=300)


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, export: Any, env: dict[str, str], keys: Keys) -> Path:
    target = tmp_path_factory.mktemp("signed") / "out"
    proc = _cli(_merge_args(export, target, "--sign-key", str(keys.signer)), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["output_dir"] == str(target)
    return target


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory: pytest.TempPathFactory, export: Any, env: dict[str, str]) -> Path:
    target = tmp_path_factory.mktemp("unsigned") / "out"
    proc = _cli(_merge_args(export, target), {k: v for k, v in env.items() if k != "MERGEFLOW_SIGN_KEY"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "copy"))


def _standard_verify(artifact: Path, public_key: Path) -> subprocess.CompletedProcess[str]:
    """The package's own verifier, as its README says to run it, in a separate process."""
    return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(artifact),
                           "--signature", str(artifact / SIGNATURE_NAME), "--public_key", str(public_key)],
                          capture_output=True, text=True, timeout=120, check=False)


def _edit_producer(artifact: Path) -> None:
    """The edit of issue 27: the manifest's producer changed, rewritten as canonical JSON (sorted keys)."""
    path = artifact / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["producer"] = {**manifest["producer"], "mergeflow": "9.9.9"}
    path.write_text(dumps_canonical(manifest))


def _repin(artifact: Path) -> None:
    (artifact / PIN_NAME).write_text(f"{sha256_file(artifact / MANIFEST_NAME)}  {MANIFEST_NAME}\n")


def _flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _forge_statement(artifact: Path) -> None:
    """Rewrite the signed statement's digests to the edited files, keeping the old signature bytes."""
    path = artifact / SIGNATURE_NAME
    bundle = json.loads(path.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    for resource in statement["predicate"]["resources"]:
        resource["digest"] = sha256_file(artifact / resource["name"])
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    path.write_text(json.dumps(bundle))


def test_the_standard_verifier_accepts_a_signed_export_and_rejects_an_edit(signed: Path, keys: Keys,
                                                                           tmp_path: Path) -> None:
    copy = _copy(signed, tmp_path)
    ok = _standard_verify(copy, keys.signer_pub)
    assert ok.returncode == 0 and "Verification succeeded" in ok.stdout, ok.stdout + ok.stderr
    wrong_key = _standard_verify(copy, keys.other_pub)
    assert wrong_key.returncode != 0 and "Verification failed" in wrong_key.stderr
    _flip(copy / WEIGHTS)
    edited = _standard_verify(copy, keys.signer_pub)
    assert edited.returncode != 0 and "Verification failed" in edited.stderr and WEIGHTS in edited.stderr
    _flip(copy / WEIGHTS)  # back: the standard verifier also sees an edit of the manifest itself
    _edit_producer(copy)
    manifest = _standard_verify(copy, keys.signer_pub)
    assert manifest.returncode != 0 and MANIFEST_NAME in manifest.stderr


def test_the_signature_covers_every_file_manifest_and_pin_included(signed: Path, keys: Keys) -> None:
    statement = read_signed_statement(signed / SIGNATURE_NAME)
    assert statement.key_fingerprint == keys.fingerprint
    files = set(list_tree(signed)) - {SIGNATURE_NAME}
    assert {MANIFEST_NAME, PIN_NAME, WEIGHTS, "config.json"} <= files
    assert statement.files == {name: sha256_file(signed / name) for name in files}
    assert statement.ignored and SIGNATURE_NAME in statement.ignored
    pinned = (signed / PIN_NAME).read_text()
    assert pinned == f"{sha256_file(signed / MANIFEST_NAME)}  {MANIFEST_NAME}\n"
    manifest = json.loads((signed / MANIFEST_NAME).read_text())
    assert SIGNATURE_NAME not in manifest["files"] and PIN_NAME not in manifest["files"]


def test_mergeflow_test_verify_key_passes_and_says_by_which_key(signed: Path, keys: Keys, env: dict[str, str]) -> None:
    proc = _cli(["test", "--backend", "fsdp", "--test_hf_dir", str(signed), "--verify-key", str(keys.signer_pub)], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "integrity": "passed", "architecture": "FluxTransformer2DModel", "signature": f"verified by {keys.fingerprint}"}
    # Without the key, the same artifact passes too: its pin and its signed statement match the files.
    assert check_artifact(signed) == {"integrity": "passed", "architecture": "FluxTransformer2DModel"}


def _added(copy: Path) -> None:
    (copy / "extra.txt").write_text("not signed")


# Each case: the edit, the file the one-line refusal must name, and what it must say.
TAMPERINGS = {
    "a weight byte": (lambda c: _flip(c / WEIGHTS), WEIGHTS, "does not match its sha256"),
    "an added file": (_added, "extra.txt", "not in the manifest"),
    "a removed file": (lambda c: (c / "config.json").unlink(), "config.json", "missing"),
    "the manifest alone": (_edit_producer, MANIFEST_NAME, f"does not match the digest {PIN_NAME} pins"),
    "the manifest and its pin": (lambda c: (_edit_producer(c), _repin(c)), MANIFEST_NAME,
                                 f"does not match its sha256 in {SIGNATURE_NAME}"),
    "the pin alone": (lambda c: (c / PIN_NAME).write_text(f"{'0' * 64}  {MANIFEST_NAME}\n"), MANIFEST_NAME,
                      f"does not match the digest {PIN_NAME} pins"),
    "manifest, pin and statement": (lambda c: (_edit_producer(c), _repin(c), _forge_statement(c)), SIGNATURE_NAME,
                                    "signature does not verify"),
}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_verify_key_names_each_tampered_file_in_one_line(signed: Path, keys: Keys, tmp_path: Path, case: str) -> None:
    copy = _copy(signed, tmp_path)
    edit, named, words = TAMPERINGS[case]
    edit(copy)
    with pytest.raises(ArtifactInvalidError) as caught:
        check_artifact(copy, keys.signer_pub)
    message = str(caught.value)
    assert "\n" not in message and named in message and words in message, message


def test_a_resigned_or_unsigned_copy_is_told_apart_only_with_the_key(signed: Path, keys: Keys, tmp_path: Path) -> None:
    copy = _copy(signed, tmp_path)
    _edit_producer(copy)
    _repin(copy)
    sign_artifact(copy, keys.other, "out")  # a consistent forgery, signed by someone else's key
    assert check_artifact(copy)["integrity"] == "passed"  # nothing unsigned can tell: README, "What the unsigned check catches"
    with pytest.raises(SigningKeyError, match="does not match the key that signed model.sig"):
        check_artifact(copy, keys.signer_pub)
    (copy / SIGNATURE_NAME).unlink()
    with pytest.raises(ArtifactInvalidError, match="model.sig is missing"):
        check_artifact(copy, keys.signer_pub)


def test_without_a_key_test_catches_the_issue_edit(unsigned: Path, env: dict[str, str], tmp_path: Path) -> None:
    assert not (unsigned / SIGNATURE_NAME).exists()
    # The pin is sha256sum's own format: the standard tool checks it too.
    sums = subprocess.run(["sha256sum", "-c", PIN_NAME], cwd=unsigned, capture_output=True, text=True, timeout=60, check=False)
    assert sums.returncode == 0 and f"{MANIFEST_NAME}: OK" in sums.stdout
    copy = _copy(unsigned, tmp_path)
    _edit_producer(copy)
    proc = _cli(["test", "--backend", "fsdp", "--test_hf_dir", str(copy)], env)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and MANIFEST_NAME in lines[0] and PIN_NAME in lines[0], proc.stderr
    (copy / PIN_NAME).unlink()
    with pytest.raises(ArtifactInvalidError, match=f"{PIN_NAME} is missing"):
        check_artifact(copy)


KEY_REFUSALS = {  # flag, key, what the line says
    "an RSA key to sign": ("--sign-key", "rsa", "is an RSA key"),
    "a public key to sign": ("--sign-key", "signer_pub", "is a public key"),
    "a random file to sign": ("--sign-key", "random", "is not a PEM private key"),
    "an encrypted key": ("--sign-key", "encrypted", "is encrypted"),
    "a missing key": ("--sign-key", None, "is not a file"),
}


@pytest.mark.parametrize("case", list(KEY_REFUSALS))
def test_a_wrong_signing_key_is_one_line_and_nothing_is_published(export: Any, keys: Keys, env: dict[str, str],
                                                                  tmp_path: Path, case: str) -> None:
    flag, which, words = KEY_REFUSALS[case]
    key = getattr(keys, which) if which else tmp_path / "absent.pem"
    target = tmp_path / "out"
    proc = _cli(_merge_args(export, target, flag, str(key)), env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mergeflow: error: --sign-key") and words in lines[0], proc.stderr
    assert not target.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_the_environment_setting_signs_and_is_checked_like_the_flag(export: Any, keys: Keys, env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    from mergeflow.config import SIGN_KEY_ENV, ModelMergerConfig

    proc = _cli(_merge_args(export, tmp_path / "out"), {**env, SIGN_KEY_ENV: str(keys.rsa)})
    assert proc.returncode == 2 and "--sign-key" in proc.stderr and "RSA" in proc.stderr, proc.stderr
    try:
        import os

        os.environ[SIGN_KEY_ENV] = str(keys.signer)
        assert ModelMergerConfig(local_dir="x").sign_key == str(keys.signer)
        assert ModelMergerConfig(local_dir="x", sign_key="given.pem").sign_key == "given.pem"
        assert ModelMergerConfig(operation="test", test_hf_dir="x").sign_key is None
    finally:
        del os.environ[SIGN_KEY_ENV]


VERIFY_REFUSALS = {
    "an RSA public key": ("rsa_pub", SigningKeyError, "is an RSA key"),
    "a private key": ("signer", SigningKeyError, "is a private key"),
    "a random file": ("random", SigningKeyError, "is not a PEM public key"),
    "another signer's key": ("other_pub", SigningKeyError, "does not match the key that signed"),
}


@pytest.mark.parametrize("case", list(VERIFY_REFUSALS))
def test_a_wrong_verify_key_is_one_line(signed: Path, keys: Keys, case: str) -> None:
    which, error, words = VERIFY_REFUSALS[case]
    with pytest.raises(error) as caught:
        check_artifact(signed, getattr(keys, which))
    assert "\n" not in str(caught.value) and words in str(caught.value) and "--verify-key" in str(caught.value)


def test_a_wrong_verify_key_on_the_command_line(signed: Path, keys: Keys, env: dict[str, str], tmp_path: Path) -> None:
    for key, words in ((keys.other_pub, "does not match the key that signed"), (keys.rsa_pub, "is an RSA key")):
        proc = _cli(["test", "--backend", "fsdp", "--test_hf_dir", str(signed), "--verify-key", str(key)], env)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    copy = _copy(signed, tmp_path)
    _flip(copy / WEIGHTS)
    proc = _cli(["test", "--backend", "fsdp", "--test_hf_dir", str(copy), "--verify-key", str(keys.signer_pub)], env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and WEIGHTS in lines[0], proc.stderr


def test_a_staging_kept_after_signing_resumes_and_is_signed_again(export: Any, keys: Keys, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from builders import plain_export

    import mergeflow.tasks.publish as publish_tasks

    target = tmp_path / "out"

    def stopped(*args: Any) -> None:
        raise ExportInterruptedError("interrupted between the signature and the publish")

    monkeypatch.setattr(publish_tasks, "publish_staged", stopped)
    with pytest.raises(ExportInterruptedError) as caught:
        plain_export(export.config(target, sign_key=str(keys.other)))
    staged = Path(str(caught.value.staging_dir)) / "artifact"
    assert read_signed_statement(staged / SIGNATURE_NAME).key_fingerprint != keys.fingerprint
    assert (staged / PIN_NAME).is_file() and not target.exists()
    monkeypatch.undo()
    plain_export(export.config(target, sign_key=str(keys.signer)))  # resumes the kept staging, signs with this key
    assert _standard_verify(target, keys.signer_pub).returncode == 0
    assert check_artifact(target, keys.signer_pub)["signature"] == f"verified by {keys.fingerprint}"


def test_a_signed_export_uploads_its_signature_and_pin(signed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hub_server import LocalHubServer
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    from mergeflow.hub.upload import upload_artifact

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as tests/test_hub_upload.py: the server is local
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHubServer() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.base_url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.base_url + "/{repo_id}/resolve/{revision}/{filename}")
        record = upload_artifact(signed, "mergeflow-tests/signed", endpoint=hub.base_url, base_delay=0.01,
                                 token="hf_" + "Token0" * 6)
        stored = hub.files("mergeflow-tests/signed")
    close_session()
    expected = set(list_tree(signed))
    assert {SIGNATURE_NAME, PIN_NAME} <= expected and record.files_verified == len(expected)
    assert set(stored) == expected | {".gitattributes"}  # the Hub's own .gitattributes: model_signing ignores it
    for name in (SIGNATURE_NAME, PIN_NAME, MANIFEST_NAME):
        assert stored[name].content == (signed / name).read_bytes()


def test_the_summary_artifact_says_signed_by_which_key(signed: Path, unsigned: Path, keys: Keys, export: Any,
                                                       prefect_api: Any) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from mergeflow.flows.artifacts import artifact_key
    from mergeflow.flows.run_names import export_label

    def summary(target: Path) -> str:
        """The export's summary: both exports share a checkpoint, so a key; the output row tells them apart."""
        key = artifact_key("merge-summary", export_label(str(target), str(export.actor_dir)))
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        mine = [str(a.data) for a in found if f"| output | `{target}` |" in str(a.data)]
        assert len(mine) == 1, f"no single artifact {key} of {target}"
        return mine[0]

    text = summary(signed)
    assert "**signed**" in text and keys.fingerprint in text
    assert f"model_signing verify key {signed} --signature {signed / SIGNATURE_NAME}" in text
    assert "--verify-key PUBLIC_KEY.pem" in text
    assert "**not signed**" in summary(unsigned) and keys.fingerprint not in summary(unsigned)


def test_deployments_take_the_key_as_a_typed_parameter(export: Any, keys: Keys, tmp_path: Path) -> None:
    from prefect.utilities.callables import parameter_schema

    from mergeflow.flows.backfill_flow import backfill_flow
    from mergeflow.flows.checkpoint import merge_checkpoint_flow
    from mergeflow.flows.validate import validate_flow
    from mergeflow.ops.serve_settings import ServeSettings

    for flow_fn, name in ((merge_checkpoint_flow, "sign_key"), (backfill_flow, "sign_key"), (validate_flow, "verify_key")):
        schema = parameter_schema(flow_fn).model_dump()["properties"][name]
        assert {"type": "string"} in schema["anyOf"] and schema.get("default") is None, schema
        assert "elliptic-curve" in schema["description"]
    settings: dict[str, Any] = {"base_model": str(export.base_dir), "target_root": str(tmp_path),
                                "checkpoint_roots": (str(tmp_path),), "output_format": "transformer"}
    served = ServeSettings(**settings, sign_key=str(keys.signer)).checked()  # type: ignore[arg-type]
    assert served.parameters()["sign_key"] == str(keys.signer.resolve())
    assert served.backfill_parameters()["sign_key"] == str(keys.signer.resolve())
    with pytest.raises(SigningKeyError, match="is an RSA key"):
        ServeSettings(**settings, sign_key=str(keys.rsa)).checked()  # type: ignore[arg-type]
