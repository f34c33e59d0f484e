"""The artifact's model card: README.md with YAML front matter, the bytes huggingface_hub's ModelCard writes.

The card says what the Hub shows (base model, relation, library, pipeline tag) and what mergeflow
proved. It is built from the manifest record and the plan, never from a path of the user's machine:
the training run and step come from verl's `<run>/global_step_N` names, the base from its Hub id.

The card is one of the manifest's `files` (its sha256), so the manifest cannot also be named by the
card's own digest (circular): the card carries `tensors_sha256`, the digest of the manifest's tensor
records (canonical JSON), which the manifest's `model_card` record repeats and `test` recomputes.

The card is rendered here, not through huggingface_hub's ModelCardData and ModelCard: importing them cost
each export 50-70 ms of CPU, a fifth of a tiny merge forked from a resident (0.30 against 0.23-0.26 CPU-s,
measured), and no resident can import huggingface_hub ahead of a command (it reads HF_* when imported:
mergeflow.ops.resident_server). The bytes are theirs: the same PyYAML dump with their options, keys in
ModelCardData's order, None left out and tags made unique. tests/test_model_card.py holds every output's
card to what huggingface_hub renders from the same fields, and parses it back with huggingface_hub's own
ModelCard.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mergeflow.errors import ArtifactInvalidError, UsageError
from mergeflow.formats.manifest import Manifest
from mergeflow.formats.quantization_summary import quantization_summary
from mergeflow.outputs.card_formats import (
    CardFacts,
    format_name,
    library_name,
    load_snippet,
    relation,
)

CARD_NAME = "README.md"
# Architectures (the manifest's root class) whose pipelines make videos, and those that edit images.
_VIDEO = ("Wan", "LTX2", "MiniMaxH3")
_EDIT = ("QwenImageEdit",)
_HF_CACHE_DIR = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")


def hub_id(text: str | None) -> str | None:
    """`text` when it is a Hub model id (`org/name`), else None (a local path is never one)."""
    if not text or text.startswith(("/", ".", "~")) or text.count("/") != 1:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return None
    return text


def check_base_model_id(value: str | None) -> None:
    """--base-model-id: refused in one line unless it is a Hub model id."""
    if value is not None and hub_id(value) is None:
        raise UsageError(f"--base-model-id must be a Hub model id (org/name), not {value!r}")


def base_model_id(flag: str | None, base_dir: str, named_base: str | None) -> str | None:
    """The base's Hub id: the flag, else the base named as an id (an adapter's), else a Hub cache snapshot's repo.

    A snapshot in the Hub cache lies at `models--<org>--<name>/snapshots/<revision>`: its repo is its id.
    A base's own README.md does not name its own repo (its `base_model` is the base's base), so it is not read.
    """
    if flag:
        return flag
    named = hub_id(named_base)
    if named is not None:
        return named
    if base_dir:
        path = Path(base_dir)
        for part in (path, *path.parents):
            if part.parent.name == "snapshots":
                match = _HF_CACHE_DIR.match(part.parent.parent.name)
                if match:
                    return f"{match['org']}/{match['name']}"
    return None


def tensors_sha256(tensors: Mapping[str, Any]) -> str:
    """sha256 of the manifest's `tensors` table as canonical JSON (sorted keys, no spaces)."""
    raw = json.dumps(tensors, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.sha256(raw).hexdigest()


def pipeline_tag(architecture: str, transformer_class: str) -> str:
    name = architecture or transformer_class
    if name.startswith(_EDIT):
        return "image-to-image"
    if name.startswith(_VIDEO) or transformer_class.startswith(_VIDEO):
        return "text-to-video"
    return "text-to-image"


def card_data(manifest: Manifest, facts: CardFacts) -> dict[str, Any]:
    """What the Hub shows, in the order huggingface_hub's ModelCardData writes it (its `to_dict`): its own
    fields first (base_model, library_name, pipeline_tag, tags), then the others (base_model_relation); a
    base without a Hub id is left out, as ModelCardData leaves out None, and the tags are unique."""
    rel = relation(manifest)
    tags = ["mergeflow", manifest.architecture, manifest.artifact_type]
    if rel == "adapter":
        tags.append("lora")
    if manifest.quantization is not None:
        tags.append(str(manifest.quantization.get("method", "quantized")))
    data: dict[str, Any] = {} if facts.base_model is None else {"base_model": facts.base_model}
    data.update(library_name=library_name(manifest),
                pipeline_tag=pipeline_tag(manifest.architecture, facts.transformer_class),
                tags=list(dict.fromkeys(tags)))
    if facts.base_model:
        data["base_model_relation"] = rel
    return data


def front_matter(data: Mapping[str, Any]) -> str:
    """The YAML block as ModelCardData.to_yaml dumps it (huggingface_hub.utils.yaml_dump: PyYAML's dump,
    unicode kept, keys unsorted), with the "\n" line break a ModelCard of "\n"-separated text keeps."""
    return str(yaml.dump(dict(data), stream=None, allow_unicode=True, sort_keys=False, line_break="\n")).strip()


def _proven(manifest: Manifest, runtime: Mapping[str, Any] | None) -> str:
    layers = ", ".join(f"{k}: {v}" for k, v in manifest.verification.items() if k != "runtime")
    summary = quantization_summary(manifest.quantization)
    if summary is None:
        lines = ["- Every tensor was reconstructed from the rank files and read back bit-exact before publication."]
    else:  # quantized values are bounded, not equal to the source: say how, and by how much
        lines = [("- Every tensor was reconstructed from the rank files bit-exact, then encoded and read back before "
                  "publication."),
                 f"- Quantized ({summary.how()}); every stored value is held to its bound: {summary.bound}."]
        worst = summary.worst_text()
        if worst is not None:
            lines.append(f"- Worst dequantization error against the source: {worst}. Each tensor's figures "
                         "and source sha256 are in the manifest's `quantization` record.")
    lines.append(f"- Validation layers: {layers}.")
    status = manifest.verification.get("runtime", "not_run")
    if runtime and status == "passed":
        stats = runtime.get("output", {})
        lines.append(f"- Runtime check: passed ({runtime.get('loaded_as')}, one denoising step on {runtime.get('device')} "
                     f"in {runtime.get('dtype')}, output {stats.get('shape')} finite, mean {stats.get('mean')}, "
                     f"std {stats.get('std')}; {runtime.get('seconds')} s).")
    else:
        lines.append(f"- Runtime check: {status} (`mergeflow smoke --test_hf_dir OUT` runs it on a copy).")
    return "\n".join(lines)


def render(manifest: Manifest, facts: CardFacts, runtime: Mapping[str, Any] | None = None) -> str:
    """The card's text: the YAML front matter (`card_data`, `front_matter`), then the body."""
    data = card_data(manifest, facts)
    checkpoint = dict(manifest.checkpoint)
    training = f"run `{facts.run}`, step {facts.step}" if facts.run else "not recorded (not a verl global_step_N layout)"
    layout = checkpoint.get("layout") or (f"verl FSDP{checkpoint.get('fsdp_version')} rank files"
                                           if checkpoint.get("fsdp_version") else "FSDP checkpoint")
    base = f"[{facts.base_model}](https://huggingface.co/{facts.base_model})" if facts.base_model else "not named (no Hub id known)"
    body = f"""
# {manifest.architecture} ({format_name(manifest)}) exported by mergeflow

A {relation(manifest)} of {base}, written by mergeflow {manifest.producer.get('mergeflow', '')} from an FSDP training checkpoint.

## Provenance

- Training: {training}
- Checkpoint: {layout}, world size {checkpoint.get('world_size')}
- Output format: {manifest.artifact_type} (tensors: {len(manifest.tensors)}, dtype {manifest.dtype})
- Manifest: `merge_manifest.json` lists every file's sha256, this card included, so the card cannot name the
  manifest's own digest. It names the digest of the manifest's tensor records instead
  (sha256 of `tensors` as canonical JSON): `{tensors_sha256(manifest.tensors_json())}`

## What was proven

{_proven(manifest, runtime)}

Check it again without the training checkpoint: `mergeflow test --backend fsdp --test_hf_dir OUT`.

## How to load

```python
{load_snippet(manifest, facts)}```
"""
    return f"---\n{front_matter(data)}\n---\n{body}"


def card_record(manifest: Manifest, facts: CardFacts) -> dict[str, Any]:
    """The manifest's `model_card` record: which file, what it declares, and the tensors digest it names."""
    return {"file": CARD_NAME, "base_model": facts.base_model, "base_model_relation": relation(manifest),
            "tensors_sha256": tensors_sha256(manifest.tensors_json())}


def check_card(root: Path, record: Any, tensors: Mapping[str, Any]) -> None:
    """`test`: the card parses with huggingface_hub and names this manifest's tensors digest."""
    if record is None:
        return
    if not isinstance(record, dict) or record.get("file") != CARD_NAME:
        raise ArtifactInvalidError("manifest model_card must be {file: README.md, ...}")
    digest = tensors_sha256(tensors)
    if record.get("tensors_sha256") != digest:
        raise ArtifactInvalidError("manifest model_card.tensors_sha256 is not the digest of its tensors")
    # Read without huggingface_hub (`test` imports no heavy library): the card's bytes are the listed ones
    # (hashed before this), so its front matter and the digest it names are checked as text.
    text = (root / CARD_NAME).read_text(encoding="utf-8")
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        raise ArtifactInvalidError(f"{CARD_NAME} has no YAML front matter")
    if digest not in text:
        raise ArtifactInvalidError(f"{CARD_NAME} does not name the manifest's tensors digest")
    front = text[4:text.index("\n---\n", 4)]
    declared = re.search(r"^base_model:\s*(\S+)\s*$", front, re.MULTILINE)
    if (declared.group(1) if declared else None) != record.get("base_model"):
        raise ArtifactInvalidError(f"{CARD_NAME}'s base_model differs from the manifest's model_card record")
