"""Hub upload and verification, end to end: the real huggingface_hub client against a local Hub-protocol server."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from hub_server import LocalHubServer
from huggingface_hub import HfApi, constants
from huggingface_hub.hf_api import RepoFile, RepoFolder
from huggingface_hub.utils import close_session
from safetensors.numpy import save_file

from mergeflow.errors import (
    UploadAuthError,
    UploadError,
    UploadTransientError,
    UploadVerificationError,
)
from mergeflow.formats.seal import SEAL_NAMES
from mergeflow.hub.retry import call_with_retries
from mergeflow.hub.upload import MANIFEST_NAME, upload_artifact, verify_upload

# huggingface_hub's own LFS PUT passes a file object as `data=`, which httpx2 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

REPO = "mergeflow-tests/tiny-export"
TOKEN = "hf_" + "Secret0Token" * 3  # shaped like a real user token so the generic scrubber is exercised too
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"
REPO_ROOT = Path(__file__).resolve().parents[1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    """A small published artifact: config, README, a ~2 MiB safetensors shard, manifest, plus one stray file."""
    root = tmp_path / "artifact"
    (root / "transformer").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"_class_name": "TinyTransformer", "hidden_size": 512}, indent=2))
    (root / "README.md").write_text("---\nlibrary_name: diffusers\n---\n# tiny export\n")
    rng = np.random.default_rng(0)
    save_file({"proj.weight": rng.standard_normal((512, 1024), dtype=np.float32)}, str(root / WEIGHTS), metadata={"format": "pt"})
    files = {p: _sha256(root / p) for p in ("config.json", "README.md", WEIGHTS)}
    manifest = {"schema_version": 1, "architecture": "tiny", "files": files}
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    (root / "notes.txt").write_text("not part of the artifact")  # must never be uploaded
    return root


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch):
    """A running local Hub-protocol server with the client set to plain HTTP + LFS (no Xet, not offline)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite runs offline; this server is local
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the test server speaks LFS, not Xet
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHubServer() as server:
        # As if HF_ENDPOINT had been set before import (both constants derive from it then): calls the
        # client makes to the default endpoint, such as its agent-registry lookup, stay on this machine.
        monkeypatch.setattr(constants, "ENDPOINT", server.base_url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.base_url + "/{repo_id}/resolve/{revision}/{filename}")
        yield server
    close_session()  # drop pooled keep-alive connections to this server


def _upload(hub: LocalHubServer, artifact: Path, **kwargs):
    kwargs.setdefault("token", TOKEN)
    return upload_artifact(artifact, kwargs.pop("repo_id", REPO), endpoint=hub.base_url, base_delay=0.01, **kwargs)


def _artifact_files(artifact: Path) -> dict[str, bytes]:
    """What the Hub must hold: the manifest's files, the manifest, and its pin and signature when present."""
    listed = json.loads((artifact / MANIFEST_NAME).read_text())["files"]
    sealed = [name for name in SEAL_NAMES if (artifact / name).is_file()]
    return {p: (artifact / p).read_bytes() for p in [*listed, MANIFEST_NAME, *sealed]}


def _assert_hub_holds_artifact(hub: LocalHubServer, artifact: Path) -> None:
    stored = hub.files(REPO)
    assert set(stored) == set(_artifact_files(artifact)) | {".gitattributes"}
    for path, content in _artifact_files(artifact).items():
        assert stored[path].content == content, path


def test_upload_commits_manifest_files_and_verifies_each(hub, artifact, caplog):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    before = _snapshot(artifact)
    record = _upload(hub, artifact)

    _assert_hub_holds_artifact(hub, artifact)  # notes.txt stayed home
    stored = hub.files(REPO)
    assert stored[WEIGHTS].lfs and not stored["config.json"].lfs
    assert record.repo_id == REPO and record.commit_sha == hub.repos[REPO].head.oid
    assert record.files_verified == 4
    assert record.bytes_verified == sum(len(c) for c in _artifact_files(artifact).values())
    assert record.url == f"{hub.base_url}/{REPO}" and record.private is False
    assert json.loads(json.dumps(record.to_dict()))["commit_sha"] == record.commit_sha
    # Small files were verified by downloading them; the LFS shard by its listed sha256 and size.
    assert hub.count("resolve", "GET") == 3 and hub.count("lfs_upload") == 1
    assert _snapshot(artifact) == before
    assert TOKEN not in caplog.text

    # verify-upload on its own checks the branch head and finds the same commit.
    assert verify_upload(artifact, REPO, token=TOKEN, endpoint=hub.base_url) == record

    # Uploading again is a no-op: no new commit, no LFS transfer.
    commits = hub.count("commit")
    again = _upload(hub, artifact)
    assert again.commit_sha == record.commit_sha
    assert hub.count("commit") == commits and hub.count("lfs_upload") == 1


def test_private_flag_reaches_the_hub(hub, artifact):
    record = _upload(hub, artifact, private=True)
    assert hub.repos[REPO].private is True and record.private is True
    public = _upload(hub, artifact, repo_id="mergeflow-tests/public-export", private=False)
    assert hub.repos["mergeflow-tests/public-export"].private is False and public.private is False


def test_private_upload_refuses_an_existing_public_repo(hub, artifact):
    _upload(hub, artifact, private=False)
    commits = hub.count("commit")
    with pytest.raises(UploadError, match="already exists and is public"):
        _upload(hub, artifact, private=True)
    assert hub.count("commit") == commits


@pytest.mark.parametrize(
    ("route", "inject"),
    [
        ("commit", lambda hub: hub.fail_next("commit", 503)),
        ("create", lambda hub: hub.fail_next("create", 429, headers={"Retry-After": "1"})),
        ("commit", lambda hub: hub.drop_next("commit")),
    ],
    ids=["503-on-commit", "429-retry-after-on-create", "connection-dropped-mid-commit"],
)
def test_transient_failure_is_retried_then_succeeds(hub, artifact, caplog, route, inject):
    inject(hub)
    start = time.monotonic()
    record = _upload(hub, artifact)
    elapsed = time.monotonic() - start
    assert hub.count(route) == 2
    assert record.commit_sha == hub.repos[REPO].head.oid
    _assert_hub_holds_artifact(hub, artifact)
    assert "retrying" in caplog.text
    if route == "create":
        assert elapsed >= 1.0  # Retry-After: 1 was honoured over the 0.01 s base delay


def test_transient_failures_stop_after_max_attempts(hub, artifact):
    before = _snapshot(artifact)
    hub.fail_next("commit", 503, count=10)
    with pytest.raises(UploadTransientError, match="after 3 attempts.*HTTP 503.*local artifact is unchanged"):
        _upload(hub, artifact, max_attempts=3)
    assert hub.count("commit") == 3
    assert set(hub.files(REPO)) == {".gitattributes"}
    assert _snapshot(artifact) == before


def test_rejected_token_is_not_retried_and_never_shown(hub, artifact, caplog):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    hub.valid_tokens = {"hf_" + "Valid0Token" * 3}
    with pytest.raises(UploadAuthError) as info:
        _upload(hub, artifact)
    message = str(info.value)
    assert "HTTP 401" in message and "hf auth login" in message and "HF_TOKEN" in message
    assert hub.count("create") == 1 and hub.count("commit") == 0
    assert TOKEN not in "".join(traceback.format_exception(info.value))
    assert TOKEN not in caplog.text


def test_forbidden_commit_is_not_retried(hub, artifact):
    hub.fail_next("commit", 403)
    with pytest.raises(UploadAuthError, match="HTTP 403.*write"):
        _upload(hub, artifact)
    assert hub.count("commit") == 1


@pytest.mark.parametrize("path", ["config.json", WEIGHTS], ids=["regular-file", "lfs-file"])
def test_corrupted_byte_on_the_hub_fails_verification(hub, artifact, path):
    before = _snapshot(artifact)
    hub.corrupt_next_commit_of(path)
    with pytest.raises(UploadVerificationError, match=f"content differs: {path}.*local artifact is untouched"):
        _upload(hub, artifact)
    assert _snapshot(artifact) == before
    # A second upload replaces the damaged file (the clean LFS object is already on the server).
    _upload(hub, artifact)
    _assert_hub_holds_artifact(hub, artifact)
    assert hub.count("lfs_upload") == 1


def test_verify_upload_reports_foreign_and_changed_files_and_reupload_repairs(hub, artifact):
    _upload(hub, artifact)
    hub.commit_files(REPO, {"extra.bin": b"\0" * 64, "config.json": b"{}"})
    with pytest.raises(UploadVerificationError, match=r"not in the manifest: extra\.bin; content differs: config\.json \(size"):
        verify_upload(artifact, REPO, token=TOKEN, endpoint=hub.base_url)
    record = _upload(hub, artifact)  # deletes extra.bin and restores config.json in one commit
    _assert_hub_holds_artifact(hub, artifact)
    assert record.commit_sha == hub.repos[REPO].head.oid


def test_interrupted_upload_rerun_completes(hub, artifact):
    """Kill an uploader in the middle of the LFS transfer, then run the upload again."""
    before = _snapshot(artifact)
    started, release = hub.stall_next_lfs_upload()
    code = "import sys; from mergeflow.hub.upload import upload_artifact; upload_artifact(sys.argv[1], sys.argv[2], base_delay=0.01)"
    env = {**os.environ, "HF_ENDPOINT": hub.base_url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-c", code, str(artifact), REPO], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert started.wait(timeout=60), "the uploader never reached the LFS transfer"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        release.set()
    assert set(hub.files(REPO)) == {".gitattributes"}  # nothing was committed
    assert hub.lfs_objects == {}  # the half-sent object was discarded

    record = _upload(hub, artifact)
    _assert_hub_holds_artifact(hub, artifact)
    assert record.files_verified == 4
    assert _snapshot(artifact) == before


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda root: (root / MANIFEST_NAME).unlink(), "merge_manifest.json is missing"),
        (lambda root: (root / WEIGHTS).unlink(), "diffusion_pytorch_model.safetensors is listed"),
        (lambda root: _rewrite_files(root, {"../escape.bin": "0" * 64}), "unsafe path '../escape.bin'"),
    ],
    ids=["no-manifest", "listed-file-missing", "unsafe-path"],
)
def test_broken_artifact_is_refused_before_any_request(hub, artifact, breakage, message):
    breakage(artifact)
    with pytest.raises(UploadError, match=message):
        _upload(hub, artifact)
    assert hub.requests == []


def _rewrite_files(root: Path, extra: dict[str, str]) -> None:
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    manifest["files"].update(extra)
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_tokens_are_scrubbed_from_retry_logs_and_errors(caplog):
    """A token inside an exception text (e.g. echoed by a proxy) never reaches a log line or our error."""
    other = "my-private-token-value"
    attempts = []

    def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionResetError(f"proxy reset while sending Authorization: Bearer {TOKEN}")
        raise ValueError(f"server said: bad header {other}")

    with pytest.raises(UploadError) as info:
        call_with_retries(flaky, what="Uploading", repo_id=REPO, secrets=[other], max_attempts=3, base_delay=0.01)
    assert len(attempts) == 2  # the connection reset was retried, the ValueError was not
    text = "".join(traceback.format_exception(info.value)) + caplog.text
    assert TOKEN not in text and other not in text and "***" in str(info.value) and "***" in caplog.text


def test_local_hub_server_speaks_tree_paths_info_and_resolve(hub, artifact):
    """The server's other read routes, through the real client: expanded trees, paths-info, LFS download."""
    record = _upload(hub, artifact)
    api = HfApi(endpoint=hub.base_url, token=TOKEN)
    top = {e.path: e for e in api.list_repo_tree(REPO, revision=record.commit_sha)}
    assert isinstance(top["transformer"], RepoFolder) and WEIGHTS not in top
    expanded = [e for e in api.list_repo_tree(REPO, recursive=True, expand=True) if isinstance(e, RepoFile)]
    assert {e.path for e in expanded} == set(_artifact_files(artifact)) | {".gitattributes"}
    assert all(e.last_commit is not None and e.last_commit.oid == record.commit_sha for e in expanded)
    (info,) = api.get_paths_info(REPO, [WEIGHTS, "absent.txt"], revision=record.commit_sha)
    assert isinstance(info, RepoFile) and info.lfs is not None and info.lfs.sha256 == _sha256(artifact / WEIGHTS)
    local = api.hf_hub_download(REPO, WEIGHTS, revision=record.commit_sha, cache_dir=artifact.parent / "cache")
    assert Path(local).read_bytes() == (artifact / WEIGHTS).read_bytes()


@pytest.mark.parametrize("quantize", ["none", "fp8"])
def test_a_single_file_export_uploads_and_verifies(hub, tmp_path, prefect_api, quantize):
    from builders import make_export

    from mergeflow import merge_model

    ex = make_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=1)
    out = Path(merge_model(ex.config(tmp_path / "out", output_format="single_file", quantize=quantize)).output_dir)
    record = _upload(hub, out)
    _assert_hub_holds_artifact(hub, out)
    assert hub.files(REPO)["transformer.safetensors"].lfs
    assert record.files_verified == len(_artifact_files(out)) == 5  # config, weights, card, manifest, its pin


def test_a_gguf_export_uploads_and_verifies(hub, tmp_path, prefect_api):
    from builders import make_export

    from mergeflow import merge_model

    ex = make_export(tmp_path / "ckpt", "QwenImageTransformer2DModel", world_size=1)
    out = Path(merge_model(ex.config(tmp_path / "out", output_format="gguf", quantize="q8_0")).output_dir)
    record = _upload(hub, out)
    _assert_hub_holds_artifact(hub, out)
    assert hub.files(REPO)["transformer.gguf"].lfs
    assert record.files_verified == len(_artifact_files(out)) == 5  # config, weights, card, manifest, its pin
