"""Event-driven runs stay inside what `serve` was given; the trigger path works with server authentication."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import make_export

from mergeflow.errors import ConfinementError, EventError
from mergeflow.events import build_checkpoint_event
from mergeflow.flows.checkpoint import resolve_checkpoint_config
from mergeflow.io.confinement import Confinement, confine_read

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def site(tmp_path: Path) -> dict[str, Path]:
    """A checkpoint root with one checkpoint, a target root, an allowed base, and a place outside all of them."""
    paths = {name: tmp_path / name for name in ("ckpts", "exports", "base", "other-base", "outside")}
    for path in paths.values():
        path.mkdir()
    paths["actor"] = paths["ckpts"] / "run-a" / "global_step_3" / "actor"
    paths["actor"].mkdir(parents=True)
    (paths["outside"] / "run-x" / "global_step_3" / "actor").mkdir(parents=True)
    return paths


def resolve(site: dict[str, Path], **payload: Any) -> Any:
    confinement = Confinement.of([str(site["ckpts"])], str(site["exports"]), [str(site["base"])])
    event = {"local_dir": str(site["actor"]), **payload}
    return resolve_checkpoint_config(event, confinement=confinement, base_model=str(site["base"]), target_root=str(site["exports"]))


def test_paths_inside_the_roots_resolve_to_real_paths(site: dict[str, Path]) -> None:
    config = resolve(site)
    assert config.local_dir == str(site["actor"].resolve())
    assert config.target_dir == str((site["exports"] / "run-a" / "global_step_3").resolve())
    assert config.base_model == str(site["base"].resolve())
    # A symlink that stays inside a root is followed and accepted.
    (site["ckpts"] / "latest").symlink_to(site["actor"].parent, target_is_directory=True)
    assert resolve(site, local_dir=str(site["ckpts"] / "latest" / "actor")).local_dir == str(site["actor"].resolve())
    named = resolve(site, target_dir=str(site["exports"] / "picked"), base_model=str(site["base"] / ".." / "base"))
    assert named.target_dir == str(site["exports"].resolve() / "picked") and named.base_model == str(site["base"].resolve())


CASES = {
    "local_dir outside every root": lambda s: {"local_dir": str(s["outside"] / "run-x" / "global_step_3" / "actor")},
    "local_dir escaping with ..": lambda s: {"local_dir": str(s["ckpts"] / ".." / "outside" / "run-x" / "global_step_3" / "actor")},
    "local_dir symlinked out": lambda s: _link(s["ckpts"] / "sneaky", s["outside"] / "run-x", {"local_dir": str(s["ckpts"] / "sneaky" / "global_step_3" / "actor")}),
    "target_dir elsewhere": lambda s: {"target_dir": str(s["outside"] / "out")},
    "target_dir escaping with ..": lambda s: {"target_dir": str(s["exports"] / ".." / "outside" / "out")},
    "target_dir the root itself": lambda s: {"target_dir": str(s["exports"])},
    "run folder symlinked out": lambda s: _link(s["exports"] / "run-a", s["outside"], {}),
    "base_model not allowed": lambda s: {"base_model": str(s["other-base"])},
    "base_model symlinked to a disallowed one": lambda s: _link(s["base"] / "alias", s["other-base"], {"base_model": str(s["base"] / "alias")}),
}


def _link(link: Path, to: Path, payload: dict[str, str]) -> dict[str, str]:
    link.symlink_to(to, target_is_directory=True)
    return payload


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_event_cannot_reach_outside_the_roots(site: dict[str, Path], case: str) -> None:
    before = sorted(p.relative_to(site["outside"]) for p in site["outside"].rglob("*"))
    with pytest.raises(ConfinementError) as info:
        resolve(site, **CASES[case](site))
    message = str(info.value)
    assert "\n" not in message and ("nothing was" in message or "--allow-base-model" in message), message
    assert sorted(p.relative_to(site["outside"]) for p in site["outside"].rglob("*")) == before


def test_a_deployment_without_roots_is_refused() -> None:
    with pytest.raises(ConfinementError, match="--checkpoint-root"):
        Confinement.of([], "/exports", ["/b"])
    with pytest.raises(ConfinementError, match="--target-root"):
        Confinement.of(["/ckpts"], None, ["/b"])


def test_validate_runs_read_only_below_the_target_root(site: dict[str, Path]) -> None:
    assert confine_read(str(site["exports"] / "a"), str(site["exports"])) == str(site["exports"].resolve() / "a")
    (site["exports"] / "peek").symlink_to(site["outside"], target_is_directory=True)
    for path in (site["outside"], site["exports"] / "peek", site["exports"] / ".." / "outside"):
        with pytest.raises(ConfinementError, match="outside"):
            confine_read(str(path), str(site["exports"]))


def test_triggered_flow_refuses_before_reading_or_writing(tmp_path: Path, prefect_api: Any) -> None:
    """The flow the trigger runs, on a real server: a hostile payload ends the run with the one line."""
    from mergeflow.flows.checkpoint import merge_checkpoint_flow
    from mergeflow.flows.validate import validate_flow

    ex = make_export(tmp_path / "train", "FluxTransformer2DModel", 1)
    exports, outside = tmp_path / "exports", tmp_path / "outside"
    exports.mkdir()
    outside.mkdir()
    (exports / "train").symlink_to(outside, target_is_directory=True)  # <root>/<run_name> points out
    _, payload = build_checkpoint_event(ex.actor_dir, run_name="train")
    served = dict(base_model=str(ex.base_dir), target_root=str(exports), checkpoint_roots=[str(tmp_path / "train")],
                  output_format="transformer")
    with pytest.raises(ConfinementError, match="outside the target root"):
        merge_checkpoint_flow(checkpoint=payload, **served)
    with pytest.raises(ConfinementError, match="outside every checkpoint root"):
        merge_checkpoint_flow(checkpoint=dict(payload, run_name="r"), **dict(served, checkpoint_roots=[str(outside)]))
    assert list(outside.iterdir()) == [] and sorted(p.name for p in exports.iterdir()) == ["train"]
    with pytest.raises(ConfinementError, match="outside"):
        validate_flow(test_hf_dir=str(ex.actor_dir), within=str(exports))


def test_event_emission_against_a_server_with_authentication(prefect_server: Any, prefect_api: Any, tmp_path: Path) -> None:
    """The session's server requires basic auth: without (or with a wrong) auth string the refusal says what to set."""
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

    from mergeflow.events import checkpoint_saved

    assert prefect_server.auth_string, "the session's server must have authentication on"
    actor = tmp_path / "run" / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    with temporary_settings(restore_defaults={PREFECT_API_AUTH_STRING}):
        with pytest.raises(EventError, match="requires authentication .*set PREFECT_API_AUTH_STRING"):
            checkpoint_saved(actor, timeout=10)
    with temporary_settings(updates={PREFECT_API_AUTH_STRING: "mergeflow:wrong"}):
        with pytest.raises(EventError, match="refused PREFECT_API_AUTH_STRING"):
            checkpoint_saved(actor, timeout=10)
    assert checkpoint_saved(actor, timeout=30)  # with the right one (the test session's), delivered


def test_merge_against_a_server_that_refuses_the_credentials_is_one_line(tmp_path: Path, prefect_server: Any) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 1)
    env = prefect_server.client_env()
    env.pop("PREFECT_API_AUTH_STRING")
    env["PYTHONPATH"] = str(REPO)
    target = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "mergeflow", "merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir),
         "--base_model", str(ex.base_dir), "--target_dir", str(target), "--output_format", "transformer"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "requires authentication" in lines[0] and "PREFECT_API_AUTH_STRING" in lines[0], done.stderr
    assert not target.exists() and not any(p.name.startswith("out.") for p in tmp_path.iterdir()), os.listdir(tmp_path)
