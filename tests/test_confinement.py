"""Event-driven runs stay inside what `serve` was given; the trigger path works with server authentication."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import forked_cli
import pytest
from builders import (
    Export,
    clone_export,
    expect_refusal,
    leftovers,
    make_export,
    plain_export,
)

from mergeflow.errors import BaseModelError, ConfinementError, EventError
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


# --- symlinks inside the inputs (issue 22, item 2) -------------------------------------------------

LINKED_OUT = ["huggingface", "fsdp_config.json", ".metadata"]  # a verl checkpoint's config dir and file, a DCP's


def _link_out(directory: Path, name: str, outside: Path) -> Path:
    """Move `directory/name` (or make one) outside and leave a symlink to it in its place."""
    moved = outside / f"moved-{name.strip('.')}"
    if (directory / name).exists():
        shutil.move(str(directory / name), moved)
    else:
        moved.write_bytes(b"not read")
    (directory / name).symlink_to(moved, target_is_directory=moved.is_dir())
    return moved


@pytest.mark.parametrize("name", LINKED_OUT)
def test_a_served_checkpoint_entry_linked_out_of_the_roots_is_refused(site: dict[str, Path], name: str) -> None:
    (site["actor"] / "huggingface").mkdir()
    (site["actor"] / "huggingface" / "config.json").write_text("{}")
    (site["actor"] / "fsdp_config.json").write_text("{}")
    _link_out(site["actor"], name, site["outside"])
    with pytest.raises(ConfinementError, match=rf"{re.escape(name)} in the event's local_dir .* outside every checkpoint root") as info:
        resolve(site)
    assert "\n" not in str(info.value) and "nothing was read" in str(info.value)


def test_a_served_checkpoint_entry_linked_inside_the_root_is_accepted(site: dict[str, Path]) -> None:
    shared = site["ckpts"] / "shared-hf"
    shared.mkdir()
    (site["actor"] / "huggingface").symlink_to(shared, target_is_directory=True)
    assert resolve(site).local_dir == str(site["actor"].resolve())


@pytest.fixture()
def ex(pristine_flux_w2: Export, tmp_path: Path) -> Export:
    """A private copy of the session's W=2 Flux checkpoint, free to damage."""
    return clone_export(pristine_flux_w2, tmp_path / "ck")


def _base_config_out(ex: Export) -> None:
    _link_out(ex.base_dir, "config.json", ex.root)


def _unread_link_in_base(ex: Export) -> None:
    (ex.base_dir / "README.md").symlink_to("config.json")  # inside the base, and never read


def _hf_cache_snapshot(ex: Export) -> None:
    blobs = ex.root / "blobs"
    blobs.mkdir()
    for path in sorted(p for p in ex.base_dir.rglob("*") if p.is_file()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.move(str(path), blob)
        path.symlink_to(os.path.relpath(blob, path.parent))


CLI_LINKS: dict[str, tuple[Callable[[Export], object], type[Exception], str]] = {
    "checkpoint huggingface/ linked out": (lambda e: _link_out(e.actor_dir, "huggingface", e.root), ConfinementError,
                                           r"huggingface in --local_dir .* outside --local_dir"),
    "checkpoint fsdp_config.json linked out": (lambda e: _link_out(e.actor_dir, "fsdp_config.json", e.root),
                                               ConfinementError, r"fsdp_config.json in --local_dir .* outside"),
    "checkpoint .metadata linked out": (lambda e: _link_out(e.actor_dir, ".metadata", e.root), ConfinementError,
                                        r"\.metadata in --local_dir .* outside"),
    "base config.json linked out": (_base_config_out, BaseModelError, r"config.json of the base is a symlink"),
    "unread link inside the base": (_unread_link_in_base, BaseModelError, r"README.md of the base is a symlink"),
    "base given as an HF cache snapshot": (_hf_cache_snapshot, BaseModelError, r"hf download"),
}


@pytest.mark.parametrize("case", sorted(CLI_LINKS))
def test_a_link_out_of_an_export_input_is_refused_before_any_read(ex: Export, case: str) -> None:
    damage, error, match = CLI_LINKS[case]
    damage(ex)
    err = expect_refusal(ex, error, match, stage="inspect")
    assert "\n" not in str(err)


def test_a_link_that_stays_inside_the_checkpoint_is_followed(ex: Export, tmp_path: Path) -> None:
    (ex.actor_dir / "huggingface").rename(ex.actor_dir / "hf-real")
    (ex.actor_dir / "huggingface").symlink_to("hf-real", target_is_directory=True)
    assert Path(plain_export(ex.config(tmp_path / "out"))["output_dir"]).is_dir()


def test_the_cli_refuses_a_base_config_linked_out_with_one_line(ex: Export, tmp_path: Path) -> None:
    _base_config_out(ex)
    target = tmp_path / "out"
    proc = forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model",
                                 str(ex.base_dir), "--target_dir", str(target), "--output_format", "transformer"],
                                {"HF_HUB_OFFLINE": "1", "PATH": os.environ["PATH"]})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "config.json of the base is a symlink" in proc.stderr
    assert leftovers(tmp_path, ".out.") == [] and not target.exists()
