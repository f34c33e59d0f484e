"""Per-range digests (manifest `file_ranges`): taken while writing, checked by `test` range by range on every core.

The exports here are real (tiny Flux, through the merge flow), with the range size lowered to a few
pages so that their small files have many ranges, as a real model's multi-gigabyte files do at 64 MiB.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import make_export

from mergeflow import merge_model
from mergeflow.errors import ArtifactInvalidError
from mergeflow.export.check import artifact_check
from mergeflow.export.check.artifact_check import check_artifact
from mergeflow.formats.manifest import FILE_RANGES, MANIFEST_NAME, check_manifest
from mergeflow.formats.seal import write_pin
from mergeflow.io import ranges as ranges_module
from mergeflow.io.ranges import RangeHasher, file_digests, file_ranges

REPO = Path(__file__).resolve().parents[1]
RANGE = 4096  # a page: the smallest range a manifest may name


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory, prefect_server: Any) -> Iterator[dict[str, Path]]:
    """A sharded transformer export and a single file (its header names its data's hash), with ranges of a page."""
    root = tmp_path_factory.mktemp("ranges")
    ex = make_export(root, "FluxTransformer2DModel", 2)
    patch = pytest.MonkeyPatch()
    patch.setattr(ranges_module, "RANGE_SIZE", RANGE)
    try:
        with prefect_server.activated():
            out = {
                # Two shards (150 KB + 122 KB): each holds more than a quarter of the bytes, so each has ranges.
                "transformer": Path(merge_model(ex.config(root / "transformer", max_shard_size=150_000)).output_dir),
                # Five shards of at most 60 KB, none more than a quarter: checked file by file, no ranges.
                "many_shards": Path(merge_model(ex.config(root / "many", max_shard_size=60_000)).output_dir),
                "single_file": Path(merge_model(ex.config(root / "single", output_format="single_file")).output_dir),
                # fp8: a single file hashed after writing (its header names a hash of computed data); GGUF likewise.
                "fp8": Path(merge_model(ex.config(root / "fp8", output_format="single_file", quantize="fp8")).output_dir),
                "gguf": Path(merge_model(ex.config(root / "gguf", output_format="gguf", quantize="q8_0")).output_dir),
            }
    finally:
        patch.undo()
    yield out


@pytest.fixture(params=["transformer", "single_file", "fp8", "gguf"])
def artifact(request: pytest.FixtureRequest, exports: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy that a test may damage."""
    return Path(shutil.copytree(exports[request.param], tmp_path / "artifact"))


def manifest_of(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST_NAME).read_text())


def weights(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".safetensors", ".gguf"))


def run_test_command(path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    return subprocess.run([sys.executable, "-m", "mergeflow", "test", "--backend", "fsdp", "--test_hf_dir", str(path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_weights_file_has_ranges_of_its_own_bytes(artifact: Path) -> None:
    manifest = manifest_of(artifact)
    recorded = manifest[FILE_RANGES]
    assert set(recorded) == set(weights(artifact)) and len(recorded) >= 1
    for rel, record in recorded.items():
        raw = (artifact / rel).read_bytes()
        assert manifest["files"][rel] == hashlib.sha256(raw).hexdigest()  # the whole-file digest is unchanged
        assert record["size"] == len(raw) and record["range_size"] == RANGE
        assert record["sha256"] == [hashlib.sha256(raw[i : i + RANGE]).hexdigest() for i in range(0, len(raw), RANGE)]
        assert len(record["sha256"]) > 2
    # Configs, the index and the card: written whole in one go, far below a real range, whole digest only.
    small = set(manifest["files"]) - set(recorded)
    assert small and all((artifact / rel).stat().st_size <= ranges_module.RANGE_SIZE for rel in small)


def test_shards_of_at_most_a_quarter_of_the_bytes_take_no_ranges_and_test_still_names_a_flipped_byte(
        exports: dict[str, Path], tmp_path: Path) -> None:
    artifact = Path(shutil.copytree(exports["many_shards"], tmp_path / "artifact"))
    manifest = manifest_of(artifact)
    shards = weights(artifact)
    sizes = {rel: (artifact / rel).stat().st_size for rel in shards}
    assert len(shards) >= 4 and all(4 * size <= sum(sizes.values()) for size in sizes.values()), sizes
    assert all(size > 2 * RANGE for size in sizes.values())  # large enough for ranges, had they been wanted
    assert FILE_RANGES not in manifest  # the extra sha256 pass was not taken
    assert check_artifact(artifact)["integrity"] == "passed"  # whole files, on every core
    rel = shards[2]
    data = bytearray((artifact / rel).read_bytes())
    data[-1] ^= 0x01
    (artifact / rel).write_bytes(bytes(data))
    with pytest.raises(ArtifactInvalidError, match=f"{rel} does not match its sha256"):
        check_artifact(artifact)


def test_a_shard_is_planned_with_ranges_when_it_holds_more_than_a_quarter_of_the_bytes() -> None:
    from mergeflow.export.write.shard_writer import pack_shards
    from mergeflow.io.ranges import large_share
    from mergeflow.records import TensorLayout, TensorWrite

    assert large_share(10, 10) and large_share(10, 39) and not large_share(10, 40)

    def writes(rows: list[int]) -> list[TensorWrite]:
        return [TensorWrite(f"t{i}", f"t{i}", TensorLayout(f"t{i}", "float32", (n, 256), None, ((0,),), ((n, 256),)),
                            "float32") for i, n in enumerate(rows)]

    four = pack_shards(writes([256] * 4), 256 * 256 * 4, "w.safetensors", "fp")  # four equal shards: a quarter each
    assert [s.ranges for s in four.shards] == [False] * 4
    uneven = pack_shards(writes([512, 128, 128, 128]), 512 * 256 * 4, "w.safetensors", "fp")  # 512 + 384 of 896 rows
    assert [s.ranges for s in uneven.shards] == [True, True]
    assert [s.ranges for s in pack_shards(writes([256] * 3), 256 * 256 * 4, "w.safetensors", "fp").shards] == [True] * 3


def test_test_checks_ranges_instead_of_hashing_the_file_whole(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    whole = artifact_check.sha256_file

    def spy(path: Path) -> str:
        hashed.append(Path(path).name)
        return whole(path)

    monkeypatch.setattr(artifact_check, "sha256_file", spy)
    assert check_artifact(artifact)["integrity"] == "passed"
    assert not {Path(rel).name for rel in weights(artifact)} & set(hashed), hashed


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_byte_in_any_range_fails_test_naming_the_file(artifact: Path, where: str) -> None:
    rel = weights(artifact)[-1]
    path = artifact / rel
    data = bytearray(path.read_bytes())
    at = 8 + 3 if where == "first" else len(data) - 1  # in the header's JSON, or the data's last byte
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    proc = run_test_command(artifact)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == ""
    assert lines == [f"mergeflow: error: {rel} does not match its sha256 in the manifest: "
                     "the file was changed or damaged"], lines


def test_a_file_that_grew_or_shrank_fails_naming_it(artifact: Path) -> None:
    rel = weights(artifact)[0]
    with open(artifact / rel, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ArtifactInvalidError, match=f"{rel} does not match its sha256"):
        check_artifact(artifact)
    os.truncate(artifact / rel, (artifact / rel).stat().st_size - 2)
    with pytest.raises(ArtifactInvalidError, match=f"{rel} does not match its sha256"):
        check_artifact(artifact)


def test_a_manifest_without_ranges_is_checked_whole(artifact: Path) -> None:
    """A manifest written before `file_ranges` existed: same artifact, re-pinned, still passes and still fails."""
    manifest = manifest_of(artifact)
    del manifest[FILE_RANGES]
    raw = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    (artifact / MANIFEST_NAME).write_bytes(raw)
    write_pin(artifact, hashlib.sha256(raw).hexdigest())
    proc = run_test_command(artifact)
    assert proc.returncode == 0, proc.stderr
    rel = weights(artifact)[-1]
    data = bytearray((artifact / rel).read_bytes())
    data[-1] ^= 0x80
    (artifact / rel).write_bytes(bytes(data))
    with pytest.raises(ArtifactInvalidError, match=f"{rel} does not match its sha256"):
        check_artifact(artifact)


def _first(manifest: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = next(iter(manifest[FILE_RANGES].values()))
    return record


@pytest.mark.parametrize("edit, match", [
    (lambda m: _first(m)["sha256"].pop(), "has .* digests: .* need"),
    (lambda m: _first(m)["sha256"].append("0" * 64), "has .* digests: .* need"),
    (lambda m: _first(m).update(size=_first(m)["size"] + RANGE), "has .* digests: .* need"),
    (lambda m: _first(m)["sha256"].__setitem__(0, "A" * 64), "not a sha256 hex digest"),
    (lambda m: _first(m).update(range_size=RANGE + 1), "positive multiple of 4096"),
    (lambda m: _first(m).update(range_size=0), "positive multiple of 4096"),
    (lambda m: _first(m).update(range_size=True), "integers"),
    (lambda m: _first(m).update(size=RANGE, sha256=["0" * 64]), "only a file of more than one range"),
    (lambda m: _first(m).update(extra=1), r"exactly \{size, range_size, sha256\}"),
    (lambda m: m[FILE_RANGES].update({"other.safetensors": _first(m)}), "does not list"),
    (lambda m: m.update({FILE_RANGES: {}}), "absent when there are none"),
    (lambda m: m.update({FILE_RANGES: []}), "must map listed files"),
], ids=["one-short", "one-more", "size-beyond", "upper-hex", "unaligned", "zero", "bool", "one-range", "extra-key",
        "unlisted", "empty", "list"])
def test_a_malformed_range_record_is_refused_in_one_line(exports: dict[str, Path], edit, match: str) -> None:  # type: ignore[no-untyped-def]
    manifest = manifest_of(exports["transformer"])
    check_manifest(json.loads(json.dumps(manifest)))  # as written: accepted
    edit(manifest)
    with pytest.raises(ArtifactInvalidError, match=match) as caught:
        check_manifest(manifest)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"manifest {FILE_RANGES}")


def test_a_malformed_range_record_fails_the_command_in_one_line(tmp_path: Path, exports: dict[str, Path]) -> None:
    artifact = Path(shutil.copytree(exports["transformer"], tmp_path / "artifact"))
    manifest = manifest_of(artifact)
    _first(manifest)["sha256"].pop()
    raw = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    (artifact / MANIFEST_NAME).write_bytes(raw)
    write_pin(artifact, hashlib.sha256(raw).hexdigest())
    proc = run_test_command(artifact)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and f"manifest {FILE_RANGES}[" in lines[0], lines


def test_a_small_export_writes_no_ranges(tmp_path: Path, prefect_api: Any) -> None:
    """At the real range size a tiny model's files are one range or less: its manifest is as before."""
    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)
    out = Path(merge_model(ex.config(tmp_path / "out")).output_dir)
    assert FILE_RANGES not in manifest_of(out)
    assert check_artifact(out)["integrity"] == "passed"


@pytest.mark.parametrize("blocks", [[1], [RANGE], [RANGE - 1, 2, RANGE + 5, 3 * RANGE], [7] * 2000])
def test_the_range_hasher_splits_any_stream_as_the_file_is_read(tmp_path: Path, blocks: list[int]) -> None:
    data = os.urandom(sum(blocks))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    hasher = RangeHasher(RANGE)
    pos = 0
    for n in blocks:
        hasher.update(memoryview(data)[pos : pos + n])
        pos += n
    streamed = hasher.finish()
    assert streamed == file_ranges(path, RANGE)
    assert streamed.size == len(data)
    assert list(streamed.sha256) == [hashlib.sha256(data[i : i + RANGE]).hexdigest() for i in range(0, len(data), RANGE)]


def test_file_digests_gives_the_whole_sha256_and_ranges_only_when_large(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranges_module, "RANGE_SIZE", RANGE)
    big, small = tmp_path / "big", tmp_path / "small"
    big.write_bytes(os.urandom(3 * RANGE + 11))
    small.write_bytes(os.urandom(RANGE))
    digest, recorded = file_digests(big)
    assert digest == hashlib.sha256(big.read_bytes()).hexdigest() and recorded == file_ranges(big, RANGE)
    assert file_digests(small) == (hashlib.sha256(small.read_bytes()).hexdigest(), None)
