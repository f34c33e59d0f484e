"""Prefect artifacts of a merge: progress while it runs, then the manifest table and a summary."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from mergeflow.export.progress import human_bytes
from mergeflow.flows.run_names import export_label
from mergeflow.formats.manifest import MANIFEST_NAME, Manifest
from mergeflow.formats.quantization_summary import quantization_summary
from mergeflow.lora.artifact import ADAPTER_DIR
from mergeflow.records import MergePlan
from mergeflow.sources.registry import source_named


def artifact_key(prefix: str, name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    cleaned = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return f"{prefix}-{cleaned}"[:100].rstrip("-")


def start_progress(plan: MergePlan, total_bytes: int) -> UUID | None:
    """The run's progress artifact: percent of the output's bytes written, counted tensor by tensor."""
    return create_progress_artifact(
        progress=0.0,
        key=artifact_key("merge-progress", export_label(plan.output.target, plan.checkpoint.actor_dir)),
        description=_progress_words(0, total_bytes),
    )


def report_progress(artifact_id: UUID | None, done: int, total: int, stopped: bool = False) -> None:
    """`done` bytes of `total` written; `stopped`: the run failed or was interrupted there (its final value)."""
    if artifact_id is not None:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / total if total > 0 else 100.0,
                                 description=_progress_words(done, total, stopped))


def _progress_words(done: int, total: int, stopped: bool = False) -> str:
    from mergeflow.export.progress import human_bytes

    words = f"{human_bytes(done)} of {human_bytes(total)} written"
    return f"Stopped: {words}" if stopped else words


# What each layer of the manifest's `verification` proved, for the summary (SPEC: verification layers).
LAYER_MEANINGS = {
    "structure": "pipeline contract, config equivalence, exact tensor coverage, base weight index, path safety",
    "source_round_trip": "every reconstructed tensor re-sliced and compared bit for bit with each rank's shard",
    "artifact_round_trip": "every written shard reopened and its tensors compared with what was meant to be written",
    "integrity": "copied files' hashes equal the base's, inputs unchanged, the staged tree passed `mergeflow test`",
    "runtime": "loaded with Diffusers and one denoising step run (finite output of the expected shape); `not_run`: "
               "merge ran without --smoke (run `mergeflow smoke --test_hf_dir OUT`, or the smoke deployment)",
}


def tree_sizes(root: Path) -> dict[str, int]:
    """Size in bytes of every file below root, by relative POSIX path."""
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


# The UI's table gives each column a share of the page: a full 64-digit sha256 was cut behind a
# scrollbar. The table shows its start (enough to tell files apart and to match by eye); the full
# digests are in the artifact's merge_manifest.json, which the table's description names.
SHORT_DIGEST_CHARS = 16


def manifest_rows(manifest: Manifest, sizes: dict[str, int]) -> list[dict[str, object]]:
    """One table row per manifest file: path, size and sha256's start (a LoRA-only export lists files below lora_adapter/)."""
    rows = []
    for rel, digest in manifest.files.items():
        size = sizes.get(rel, sizes.get(f"{ADAPTER_DIR}/{rel}"))
        rows.append({"file": rel, "size": human_bytes(size) if size is not None else "?", "bytes": size,
                     "sha256": f"{digest[:SHORT_DIGEST_CHARS]}…"})
    return rows


def validate_command(output_dir: str) -> str:
    return f"mergeflow test --backend fsdp --test_hf_dir {shlex.quote(output_dir)}"


def checkpoint_kind(plan: MergePlan) -> str:
    """How the summary names the checkpoint's layout (its source says): verl's FSDP version, or a DCP (which does not record it)."""
    return source_named(plan.checkpoint.format).label(plan.checkpoint)


def summary_markdown(plan: MergePlan, manifest: Manifest, output_dir: str, total_bytes: int) -> str:
    """The export at a glance: source, base, output, what each verification layer proved, how to re-check it."""
    tensor_bytes = sum(_numel(info.shape) * _itemsize(info.dtype) for info in manifest.tensors.values())
    layers = [f"| {layer} | {state} | {LAYER_MEANINGS.get(layer, '')} |" for layer, state in manifest.verification.items()]
    return "\n".join([
        f"# Merged {manifest.architecture}",
        "",
        "| field | value |",
        "|---|---|",
        f"| source | `{plan.checkpoint.actor_dir}` |",
        f"| base model | `{plan.base.base_dir}` |" if plan.base.base_dir else "| base model | a Hub model (see the manifest) |",
        f"| output | `{output_dir}` |",
        f"| artifact type | {manifest.artifact_type} |",
        f"| world size | {plan.checkpoint.world_size} ({checkpoint_kind(plan)}) |",
        f"| tensors | {len(manifest.tensors)} ({human_bytes(tensor_bytes)}) |",
        f"| files | {len(manifest.files) + 1} ({human_bytes(total_bytes)}) |",
        f"| dtype policy | {manifest.dtype} |",
        *quantization_rows(manifest.quantization),
        *runtime_rows(manifest.runtime),
        *card_rows(manifest.model_card),
        f"| source fingerprint | `{manifest.source_fingerprint[:16]}` |",
        "",
        "## Verification (all before publication)",
        "",
        "| layer | result | what it checked |",
        "|---|---|---|",
        *layers,
        "",
        "Re-check the published artifact at any time, without the source checkpoint:",
        "",
        f"```\n{validate_command(output_dir)}\n```",
    ])


def seal_markdown(output_dir: Path) -> str:
    """How the published artifact is sealed: the manifest's pin, and whether (by which key) it is signed."""
    from mergeflow.formats.seal import PIN_NAME, SIGNATURE_NAME, read_signed_statement
    from mergeflow.lora.artifact import adapter_only_root

    home = adapter_only_root(output_dir) or output_dir
    signature = home / SIGNATURE_NAME
    pin = (home / PIN_NAME).read_text().split()[0] if (home / PIN_NAME).is_file() else None
    lines = ["", "", "## Seal", "", "| field | value |", "|---|---|",
             f"| manifest pin | `{PIN_NAME}`: sha256 `{pin[:SHORT_DIGEST_CHARS]}…` of {MANIFEST_NAME} |" if pin
             else f"| manifest pin | none ({PIN_NAME} missing) |"]
    if not signature.is_file():
        lines.append("| signature | **not signed** (no `--sign-key` / `MERGEFLOW_SIGN_KEY`): the unsigned check catches "
                     "an edit of the manifest alone, not a forged manifest with its pin |")
        return "\n".join(lines)
    key = read_signed_statement(signature).key_fingerprint
    where = shlex.quote(str(home))
    verify = (f"model_signing verify key {where} --signature {shlex.quote(str(signature))} --public_key PUBLIC_KEY.pem\n"
              f"{validate_command(str(output_dir))} --verify-key PUBLIC_KEY.pem")
    lines += [f"| signature | **signed**, OpenSSF model signing (`{SIGNATURE_NAME}`), every file covered |",
              f"| signing key | sha256 fingerprint `{key}` |", "",
              "Verify it with the standard tool, or with mergeflow, given the signer's public key:", "",
              f"```\n{verify}\n```"]
    return "\n".join(lines)


def runtime_rows(record: Mapping[str, Any] | None) -> list[str]:
    """The runtime check's row (merge --smoke): how it loaded, where it ran, how long, what came out."""
    if not record:
        return ["| runtime check | not_run (merge without --smoke) |"]
    output = record.get("output") or {}
    row = (f"| runtime check | {record.get('status')}: {record.get('loaded_as')}, {record.get('step')} on "
           f"{record.get('device')} ({record.get('dtype')}) in {record.get('seconds')} s, peak "
           f"{human_bytes(int(record.get('peak_memory_bytes') or 0))}; output {output.get('shape')} finite, "
           f"mean {output.get('mean')}, std {output.get('std')} |")
    return [row]


def card_rows(record: Mapping[str, Any] | None) -> list[str]:
    """The model card's row: what the Hub will show as its base and relation."""
    if not record:
        return []
    base = record.get("base_model") or "not named (no Hub id known; --base-model-id names it)"
    return [f"| model card | README.md: {record.get('base_model_relation')} of {base} |"]


def quantization_rows(record: Mapping[str, Any] | None) -> list[str]:
    """A quantized file's rows: how, how many tensors, and the worst dequantization error (from the manifest)."""
    summary = quantization_summary(record)
    if summary is None:
        return []
    rows = [f"| quantized | {summary.how()} |"]
    worst = summary.worst_text()
    if worst is not None:
        rows.append(f"| worst dequantization error | {worst}; {summary.bound} |")
    return rows


def publish_manifest_artifacts(plan: MergePlan, manifest: Manifest, output_dir: str, label: str) -> tuple[int, int]:
    """The manifest as a table (one row per file, with sizes) and a markdown summary; returns the published
    artifact's file count and bytes (every file: the manifest, its pin and a signature included)."""
    sizes = tree_sizes(Path(output_dir))
    total = sum(sizes.values())
    create_table_artifact(table=manifest_rows(manifest, sizes), key=artifact_key("merge-manifest", label),
                          description=f"Files of the published artifact: size and the start of each sha256 "
                                      f"(the full digests are in its {MANIFEST_NAME})")
    create_markdown_artifact(markdown=summary_markdown(plan, manifest, output_dir, total) + seal_markdown(Path(output_dir)),
                             key=artifact_key("merge-summary", label), description="Export summary")
    if plan.extract is not None:
        publish_extraction_artifact(Path(output_dir), label)
    return len(sizes), total


def publish_extraction_artifact(output_dir: Path, label: str) -> None:
    """--extract-lora: per layer rank, retained energy and max error, worst layers first, from the published record."""
    from mergeflow.errors import ArtifactInvalidError
    from mergeflow.io.jsonfiles import read_json_strict
    from mergeflow.lora.extract_spec import (
        EXTRACTION_NAME,
        extraction_diff_rows,
        extraction_rows,
        extraction_words,
    )

    record = read_json_strict(output_dir / ADAPTER_DIR / EXTRACTION_NAME, ArtifactInvalidError, EXTRACTION_NAME)
    create_table_artifact(table=extraction_rows(record), key=artifact_key("merge-extraction", label),
                          description=extraction_words(record))
    diff_rows = extraction_diff_rows(record)
    if diff_rows:  # the changed tensors no LoRA carries: which went to .diff entries, which were left out and why
        create_table_artifact(table=diff_rows, key=artifact_key("merge-extraction-diffs", label),
                              description="Changed tensors that are not LoRA'd linear weights: the norm of each "
                                          "change and the .diff / .diff_b entry written for it (or why none)")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    from mergeflow.formats.safetensors_format import DTYPES

    return DTYPES[dtype][1]
