"""The command line's help and flag errors: required flags marked, defaults shown, every flag explained, one-line errors."""

from __future__ import annotations

import argparse
import re

import pytest

from mergeflow.deployments.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, name: str = "mergeflow") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _parsers(sub, sub_name)
    return found


def test_every_flag_of_every_command_has_help() -> None:
    missing = [(name, a.dest) for name, p in _parsers(build_parser()) for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and a.dest != "help" and not a.help]
    assert missing == []


def test_merge_help_marks_required_flags_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["merge", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())  # the options, unwrapped
    for flag in ("--local_dir", "--target_dir", "--base_model", "--backend"):
        assert re.search(re.escape(flag) + r" [A-Z_{}a-z]+(, --[-a-z]+ [A-Z_]+)? \(required\) ", text), flag
    assert "(default: preserve)" in text and "(default: pipeline)" in text and "(default: 2147483648)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_every_default_is_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    # The formatter appends "(default: X)"; a help text that says its default itself said it twice.
    def shown(p: argparse.ArgumentParser, a: argparse.Action) -> str:  # the help line as --help prints it
        return (p.formatter_class(p.prog)._get_help_string(a) or "") % dict(vars(a), prog=p.prog)  # type: ignore[attr-defined]

    twice = [(name, a.dest) for name, p in _parsers(build_parser()) for a in p._actions if shown(p, a).count("(default") > 1]
    assert twice == []
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    limit = text.split("--limit LIMIT ", 1)[1].split(" --", 1)[0]
    assert limit == "merges running at the same time (default: 1)"


def test_version_names_the_libraries_that_shape_the_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    line = capsys.readouterr().out.strip()
    assert done.value.code == 0 and "\n" not in line
    assert line.startswith("mergeflow ") and all(f"{lib} " in line for lib in ("torch", "diffusers", "prefect", "safetensors"))


@pytest.mark.parametrize("argv,words", [
    (["merge", "--backend", "fsdp", "--local_dir", "/c", "--target_dir", "/t", "--base_model", "/b", "--dtype", "bf16"],
     ["--dtype", "'bf16'", "'bfloat16'"]),
    (["merge", "--backend", "fsdp", "--local_dir", "/c", "--base_model", "/b"], ["--target_dir"]),
    (["merge", "--local_dir", "/c"], ["--backend"]),
    (["serve", "--base_model", "/b", "--target-root", "/t"], ["--checkpoint-root"]),
    (["backfill", "/r", "--base_model", "/b", "--target-root", "/t", "--workers", "0"], ["--workers", "between 1 and"]),
    (["backfill", "/r", "--base_model", "/b", "--target-root", "/t", "--max-shard-size", "2G"],
     ["--max_shard_size", "'2G' is not an integer number of bytes"]),
])
def test_a_bad_flag_is_one_line_with_what_is_valid(argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"mergeflow {argv[0]}: error: ") and "--help" in err and all(w in err for w in words), err
