"""The command line as users type it: separate processes (tests/forked_cli.py) against the session's real Prefect server."""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
from pathlib import Path

import forked_cli
import pytest
from builders import Export, clone_export, leftovers, make_export, tree_digest

from mergeflow.flows.cli import build_parser

# The W=2 Flux checkpoints are copies of the session's (conftest.pristine_flux_w2, builders.clone_export), free to damage.


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300,
            rlimits: forked_cli.RLimits | None = None) -> subprocess.CompletedProcess[str]:
    return forked_cli.mergeflow(args, env, timeout=timeout, rlimits=rlimits)


@pytest.fixture()
def env(prefect_server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    e = prefect_server.client_env()
    e["HF_HUB_OFFLINE"] = "1"
    return e


def remembered(ex: Export) -> Export:
    """`ex`, its model schema put in this session's cache (MERGEFLOW_CACHE_DIR, which commands inherit).

    Built here, where make_export already imported Diffusers, rather than in each command, which would
    import it again (3-5 s) to reach the same answer: model_schema never depends on the cache
    (tests/test_schema_cache.py). Which test of a worker's session merges a model first is otherwise
    a matter of scheduling.
    """
    from mergeflow.architectures.adapters import diffusers_schema

    diffusers_schema(json.loads((ex.actor_dir / "huggingface" / "config.json").read_text()),
                     json.loads((ex.base_dir / "config.json").read_text()))
    return ex


def merge_args(ex, target: Path, *extra: str) -> list[str]:  # type: ignore[no-untyped-def]
    return ["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--target_dir", str(target),
            "--base_model", str(ex.base_dir), "--output_format", "transformer", *extra]


def test_merge_then_test_print_one_json_line(tmp_path: Path, env: dict[str, str]) -> None:
    ex = remembered(make_export(tmp_path, "FluxTransformer2DModel", 3))
    target = tmp_path / "out"
    proc = run_cli(merge_args(ex, target), env)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert json.loads(last) == {"output_dir": str(target), "manifest_path": str(target / "merge_manifest.json")}
    assert "tensors)" in proc.stderr and "mergeflow: wrote " in proc.stderr  # the progress lines (tests/test_progress.py)
    assert "Traceback" not in proc.stderr
    proc = run_cli(["test", "--backend", "fsdp", "--test_hf_dir", str(target)], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"integrity": "passed", "architecture": "FluxTransformer2DModel"}


def test_bad_input_is_one_line_and_nonzero(tmp_path: Path, env: dict[str, str], pristine_flux_w2: Export) -> None:
    ex = clone_export(pristine_flux_w2, tmp_path)
    (ex.actor_dir / "model_world_size_2_rank_1.pt").unlink()
    proc = run_cli(merge_args(ex, tmp_path / "out"), env)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mergeflow: error:") and "missing" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_cli(merge_args(ex, tmp_path / "out", "--debug"), env)
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_test_command_fails_on_a_changed_byte(tmp_path: Path, env: dict[str, str], pristine_flux_w2: Export) -> None:
    ex = remembered(clone_export(pristine_flux_w2, tmp_path))
    target = tmp_path / "out"
    assert run_cli(merge_args(ex, target), env).returncode == 0
    weights = target / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x80
    weights.write_bytes(bytes(data))
    proc = run_cli(["test", "--backend", "fsdp", "--test_hf_dir", str(target)], env)
    assert proc.returncode == 2 and "sha256" in proc.stderr and proc.stdout == ""


def test_two_concurrent_merges_to_one_target_publish_once(tmp_path: Path, env: dict[str, str]) -> None:
    ex = remembered(make_export(tmp_path, "SD3Transformer2DModel", 4))
    target = tmp_path / "out"
    results: list[subprocess.CompletedProcess[str]] = []

    def go() -> None:
        results.append(run_cli(merge_args(ex, target, "--max_shard_size", "30000"), env))

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2], [r.stderr for r in results]
    loser = next(r for r in results if r.returncode)
    assert "another mergeflow export" in loser.stderr or "already exists" in loser.stderr
    assert leftovers(tmp_path, ".out.") == []
    run = run_cli(["test", "--backend", "fsdp", "--test_hf_dir", str(target)], env)
    assert run.returncode == 0


def test_inspect_describes_the_checkpoint(tmp_path: Path, env: dict[str, str]) -> None:
    ex = make_export(tmp_path, "WanTransformer3DModel", 4, mesh_shape=(2, 2))
    proc = run_cli(["inspect", "--local_dir", str(ex.actor_dir)], env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["world_size"] == 4 and info["layout"] == "HSDP" and info["class_name"] == "WanTransformer3DModel"
    assert info["tensors"] == len(ex.actor.state_dict()) and info["lora_adapters"] == []
    assert info["bytes"] == sum(v.numel() * v.element_size() for v in ex.actor.state_dict().values())


def test_demo_leads_somewhere(tmp_path: Path, env: dict[str, str]) -> None:
    """The demo keeps its work under the cache dir, exports a pipeline, and prints commands that run as printed."""
    env = {**env, "MERGEFLOW_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_cli(["demo"], env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    demo_dir = tmp_path / "cache" / "demo"
    assert info["demo_dir"] == str(demo_dir) and f"working in {demo_dir}" in proc.stderr
    assert info["integrity"] == "passed" and info["architecture"] == "QwenImagePipeline"
    output = Path(info["output_dir"])
    assert output == demo_dir / "exports" / "pipeline-1" and (output / "model_index.json").is_file()
    # The UI link it repeats is the merge's own run.
    link = next(line.split(": ", 2)[2] for line in proc.stderr.splitlines() if line.startswith("mergeflow: flow run merge-"))
    assert f"mergeflow demo: this export in the Prefect UI: {link}" in proc.stderr.splitlines()
    lines = proc.stderr.splitlines()
    commands = [shlex.split(line.split("mergeflow demo:   ", 1)[1]) for line in lines if line.startswith("mergeflow demo:   ")]
    assert [c[:2] for c in commands] == [["mergeflow", "inspect"], ["mergeflow", "merge"], ["mergeflow", "test"],
                                         ["mergeflow", "smoke"]]
    for argv in commands:  # each runs as printed, and the new target did not exist before
        run = run_cli(argv[1:], env)
        assert run.returncode == 0, (argv, run.stderr)
    # The demo's pipeline runs: its one-step runtime check passed (the last command's JSON line).
    assert json.loads(run.stdout.strip().splitlines()[-1])["status"] == "passed"
    assert (demo_dir / "exports" / "transformer-1" / "config.json").is_file()
    # A second demo reuses the checkpoint, keeps the first export and exports to the next target.
    second = run_cli(["demo"], env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1])["output_dir"] == str(demo_dir / "exports" / "pipeline-2")
    assert "building a tiny" not in second.stderr and (output / "merge_manifest.json").is_file()
    assert "transformer-2" in second.stderr  # its printed merge names a target that does not exist yet
    # Inputs an earlier version of the demo built (no version mark) are rebuilt, not reused.
    (demo_dir / "inputs-version").unlink()
    third = run_cli(["demo"], env)
    assert third.returncode == 0 and "building a tiny" in third.stderr, third.stderr


def test_every_reference_flag_is_accepted() -> None:
    parser = build_parser()
    for spelling in (
        ["--max_shard_size", "5", "--output_format", "transformer", "--base_model", "b", "--hf_upload_path", "o/r", "--adapter_name", "x"],
        ["--max-shard-size", "5", "--output-format", "transformer", "--base-model", "b", "--adapter-name", "x"],
    ):
        args = parser.parse_args(["merge", "--backend", "fsdp", "--local_dir", "l", "--target_dir", "t",
                                  "--hf_model_config_path", "h", "--dtype", "bfloat16", "--private",
                                  "--trust-checkpoint", "--trust-remote-code", "--fuse-lora", *spelling])
        assert args.max_shard_size == 5 and args.output_format == "transformer" and args.base_model == "b"
        assert args.adapter_name == "x" and args.fuse_lora and args.trust_checkpoint and args.trust_remote_code
    with pytest.raises(SystemExit):
        parser.parse_args(["merge", "--backend", "fsdp", "--max_shard_size", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["merge", "--backend", "megatron"])


def test_merge_uploads_to_a_hub_and_reports_it(tmp_path: Path, env: dict[str, str], pristine_flux_w2: Export) -> None:
    from hub_server import LocalHubServer

    ex = remembered(clone_export(pristine_flux_w2, tmp_path))
    target = tmp_path / "out"
    with LocalHubServer() as hub:
        hub_env = dict(env, HF_ENDPOINT=hub.base_url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", HF_TOKEN="hf_" + "x" * 30)
        proc = run_cli(merge_args(ex, target, "--hf_upload_path", "team/tiny", "--private"), hub_env)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["upload"]["status"] == "uploaded" and out["upload"]["private"] is True
        assert out["upload"]["files_verified"] == 5  # config, weights, card, manifest, its pin
        remote = {k: v for k, v in hub.files("team/tiny").items() if k != ".gitattributes"}
        assert set(remote) == set(tree_digest(target))
        link = _read_artifact(prefect_server_url(env), "hub-team-tiny")
        # Prefect stores a link artifact as a markdown link to the repo page.
        assert link.type == "markdown" and f"]({hub.base_url}/team/tiny)" in str(link.data)
        hub.fail_next("preupload", 401, count=5)
        before = tree_digest(target)
        proc = run_cli(["upload", "--test_hf_dir", str(target), "--hf_upload_path", "team/tiny"], hub_env)
        assert proc.returncode == 2, proc.stderr
        assert "401" in proc.stderr and hub_env["HF_TOKEN"] not in proc.stderr
        assert tree_digest(target) == before
        proc = run_cli(["verify-upload", "--test_hf_dir", str(target), "--hf_upload_path", "team/tiny"], hub_env)
        assert proc.returncode == 0, proc.stderr


def prefect_server_url(env: dict[str, str]) -> str:
    return env["PREFECT_API_URL"]


def _read_artifact(api_url: str, key: str):  # type: ignore[no-untyped-def]
    """The latest artifact with `key`, read back through the Prefect client."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read():  # type: ignore[no-untyped-def]
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        found = asyncio.run(read())
    assert found, f"no artifact {key}"
    return found[0]


def test_disk_full_is_one_line_and_keeps_the_staging_for_resume(tmp_path: Path, env: dict[str, str],
                                                                 pristine_flux_w2: Export) -> None:
    """A file-size limit makes the shard write fail like a full disk (EFBIG instead of ENOSPC)."""
    import resource

    ex = remembered(clone_export(pristine_flux_w2, tmp_path))
    target = tmp_path / "out"
    # The limit is set in the command before it runs (forked_cli). No SIGXFSZ to ignore by hand: Python
    # ignores it from start-up on, cold or forked, so a write past the limit fails with EFBIG.
    proc = run_cli(merge_args(ex, target), env, rlimits={resource.RLIMIT_FSIZE: (100_000, 100_000)})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("mergeflow: 0 tensors")]
    assert lines[-1].startswith("mergeflow: error: no space left") and "resume" in lines[-1], proc.stderr
    assert not target.exists()
    kept = leftovers(tmp_path, ".out.")
    assert len(kept) == 1 and ".mergeflow-staging-" in kept[0]
    proc = run_cli(merge_args(ex, target), env)  # space is back: the same command resumes and publishes
    assert proc.returncode == 0, proc.stderr
    assert leftovers(tmp_path, ".out.") == []
