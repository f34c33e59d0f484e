"""`JsonObject` (an untyped dict) stays at the JSON edges; inside, values have named shapes (issue 23, item 4)."""

from __future__ import annotations

import re

from test_packaging import REPO, _product_sources

# The modules where a JSON object has no shape yet, and why each is an edge.
EDGES = {
    "mergeflow/io/jsonfiles.py": "defines it; the strict parser's object hook builds one",
    "mergeflow/io/config_paths.py": "a copied config's parsed JSON, rewritten to bytes",
    "mergeflow/lora/config.py": "lora_train_meta.json and adapter_config.json as parsed",
    "mergeflow/export/check/artifact_check.py": "merge_manifest.json as parsed, before check_manifest",
    "mergeflow/events.py": "the checkpoint-saved event's payload",
    "flows/events.py": "the event payload's extra keys",
    "flows/checkpoint.py": "the event payload a triggered run receives",
    "mergeflow/ops/serve_settings.py": "the deployments' parameters sent to Prefect",
}
MAX_USES = 40


def test_json_objects_stay_at_the_json_edges() -> None:
    uses: dict[str, int] = {}
    for path in _product_sources():
        count = len(re.findall(r"\bJsonObject\b", path.read_text()))
        if count:
            uses[path.relative_to(REPO).as_posix()] = count
    assert "mergeflow/io/jsonfiles.py" in uses  # the scan sees the definition
    inside = sorted(set(uses) - set(EDGES))
    assert not inside, f"JsonObject used away from the JSON edges (give the value a named shape): {inside}"
    assert sum(uses.values()) <= MAX_USES, uses
