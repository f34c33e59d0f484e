"""Keeping the user's local paths out of copied configs: which files count, what is removed.

Only small JSON configs are touched (`*config.json`, the pipeline indexes,
`special_tokens_map.json`); vocabularies such as `tokenizer.json` are data and stay byte for byte.
A config is rewritten only when something is removed, keeping its key order, and every removal
is returned so that the manifest can record it. The one rule for every config an artifact holds:
the copied ones and the trained component's own config.json (`shard_writer.write_component_config`).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from mergeflow.errors import BaseModelError
from mergeflow.io.jsonfiles import JsonObject, parse_json_strict

PATH_KEYS = ("_name_or_path", "name_or_path")
_INDEXES = ("model_index.json", "modular_model_index.json")
_OTHER_CONFIGS = ("special_tokens_map.json",)


def is_config_json(rel_path: str) -> bool:
    """True for the JSON configs whose local-path keys are removed on copy."""
    name = PurePosixPath(rel_path).name
    if name.endswith(".index.json"):  # weight maps: data, never rewritten
        return False
    return name.endswith("config.json") or name in _INDEXES or name in _OTHER_CONFIGS


def is_local_path(value: object) -> bool:
    """An absolute, home-relative or Windows-drive path: something only the producing machine has."""
    if not isinstance(value, str) or not value:
        return False
    return value.startswith(("/", "~", "\\")) or (len(value) > 2 and value[1] == ":" and value[2] in "\\/")


def _strip(data: JsonObject, file_name: str) -> list[str]:
    removed = [key for key in PATH_KEYS if key in data]
    # Tokenizer configs saved by older transformers name their files by absolute path; transformers
    # prefers such a value over the file in the folder, so it would break the artifact elsewhere.
    removed += [key for key, value in data.items() if key.endswith("_file") and is_local_path(value)]
    for key in removed:
        del data[key]
    if file_name == "modular_model_index.json":
        # ModularPipeline.save_pretrained writes the save directory into every component spec;
        # with the component's files present, Diffusers loads the local copy, so the path is noise.
        for name, value in data.items():
            if isinstance(value, list) and len(value) == 3 and isinstance(value[2], dict):
                if is_local_path(value[2].get("pretrained_model_name_or_path")):
                    value[2]["pretrained_model_name_or_path"] = None
                    removed.append(f"{name}.pretrained_model_name_or_path")
    return removed


def strip_local_paths(rel_path: str, raw: bytes, base_dir: str) -> tuple[bytes, list[str]]:
    """The config's bytes with local-path keys removed (unchanged bytes when there are none), and those keys."""
    data = parse_json_strict(raw, BaseModelError, f"{rel_path} of the base")
    if not isinstance(data, dict):
        raise BaseModelError(f"{rel_path} of the base must be a JSON object")
    removed = _strip(data, PurePosixPath(rel_path).name)
    out = raw
    if removed:
        out = (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    # A JSON string that starts with the base's own path (the way configs embed paths).
    if base_dir and f'"{base_dir}'.encode("utf-8") in out:
        raise BaseModelError(
            f"{rel_path} of the base names the base directory itself ({base_dir}); a local path must not reach "
            "the artifact: remove it from that file and rerun"
        )
    return out, removed
