"""The order the suite's tests run in: the longest first, split across the xdist workers by their length.

`--dist worksteal` hands each worker a contiguous block of the collection (block i is
len(pending) // (workers - i) long) and runs each block front to back; an idle worker steals the
back half of the longest queue. In collection (file) order the longest tests sat near the end
(test_serve*.py, test_ui_browser.py), so the suite's last minutes were one worker finishing a
three-minute test while the other idled. Here the known-long tests are dealt out to the blocks
longest first (each to the block with the least known time so far), lead their block, and the rest
of the collection fills the blocks in its own order: the short tests end the run, where stealing
balances them.

Only the order changes: every test runs, with the same fixtures. A test that uses a module-scoped
fixture moves with its whole module (in the module's own order), so that fixture is still built
once. A test missing from SECONDS keeps its place; a name here that no longer exists is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

# Seconds (call + setup) measured with `--durations` on a loaded two-core machine; only their
# relative size matters. A key is a test's node id (its parametrized ids included, or without
# them: all of them) or a module's path (its tests as one block).
SECONDS: dict[str, float] = {
    "tests/test_cluster.py": 180,  # one module-scoped cluster; ~60 s of it is a wait for missing heartbeats
    "tests/test_serve_startup.py::test_serve_watch_and_backfill_without_an_api_url_share_the_local_server": 120,
    "tests/test_serve.py::test_event_and_watcher_start_merges_validate_and_backfill_run_alone": 100,
    "tests/test_progress.py::test_prefect_s_telemetry_notice_comes_before_the_progress_never_inside_it": 60,
    "tests/test_interrupts.py::test_ctrl_c_without_a_server_is_one_line_too": 49,
    "tests/test_resume.py::test_dask_local_cluster_gives_a_byte_identical_artifact": 49,
    "tests/test_cli.py::test_demo_leads_somewhere": 43,
    "tests/test_serve.py::test_prefect_yaml_deploys_with_prefect_deploy_all": 42,
    "tests/test_dcp.py": 95,  # module fixtures: a real gloo DCP, a bf16 PEFT DCP
    "tests/test_ui_browser.py::test_printed_links_open_the_run_in_a_browser": 40,
    "tests/test_disk_full.py::test_enospc_at_every_durable_write_is_one_error_and_resumes": 34,
    "tests/test_dcp_integrity.py::test_a_cli_merge_s_full_disk_names_the_shard_file_and_its_stderr_has_no_diffusers_line": 34,
    "tests/test_local_server.py::test_a_server_whose_ui_asks_another_port_is_replaced": 32,
    "tests/test_bounds.py::test_the_cli_refuses_a_huge_layer_count_in_one_line": 30,
    "tests/test_resume.py::test_retry_of_the_same_flow_run_reuses_shards": 28,
    "tests/test_progress.py::test_the_cli_prints_the_phases_to_a_pipe": 25,
    "tests/test_schema_cache.py::test_a_remembered_schema_needs_no_diffusers_import": 24,
    "tests/test_fsdp1.py": 50,  # module fixtures: real FSDP1 checkpoints per sharding strategy
    "tests/test_crash_recovery.py::test_a_kill_at_every_durable_write_resumes_to_the_same_bytes": 18,
    "tests/test_backfill.py": 35,
    "tests/test_lora_fusion.py::test_checkpoint_refusals_leave_no_output": 13,
    "tests/test_resume.py::test_merge_killed_mid_write_resumes_byte_identical": 13,
    "tests/test_resume.py::test_an_orphaned_staging_dir_is_named": 11,
    "tests/test_bounds.py::test_a_huge_layer_count_in_the_base_config_is_refused_and_named": 11,
    "tests/test_cli.py::test_merge_uploads_to_a_hub_and_reports_it": 11,
    "tests/test_bounds.py::test_every_known_full_size_model_fits_the_smallest_checkpoint_budget": 10,
    "tests/test_events.py::test_without_api_url_it_fails_loudly_and_starts_no_server": 10,
    "tests/test_local_server.py::test_second_merge_reuses_the_background_server": 10,
    "tests/test_lora_fusion.py::test_minimax_h3_native_fuses_before_conversion_and_refuses_adapters": 9,
    "tests/test_disk_full.py::test_enospc_while_building_a_pipeline_resumes": 17,
    "tests/test_resume.py::test_a_rerun_from_another_cwd_with_other_spellings_resumes": 9,
    "tests/test_resume.py::test_failed_validation_keeps_staging_and_a_fresh_run_reuses_shards": 9,
    "tests/test_cli.py::test_two_concurrent_merges_to_one_target_publish_once": 9,
    "tests/test_full_scale_generator.py::test_mergeflow_exports_and_validates_a_generated_checkpoint": 8,
    "tests/test_interrupts.py::test_an_interrupted_export_ends_with_one_line_and_resumes": 16,
    "tests/test_pipelines.py": 40,
    "tests/test_confinement.py::test_merge_against_a_server_that_refuses_the_credentials_is_one_line": 8,
}


def _weight(nodeid: str) -> float:
    """The known seconds of one test: its own entry, or its entry without the parametrized ids."""
    return SECONDS.get(nodeid, SECONDS.get(nodeid.split("[", 1)[0], 0.0))


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return any(d.scope in ("module", "class", "package") for each in defs.values() for d in each)


def _block_sizes(total: int, workers: int) -> list[int]:
    """The lengths of xdist worksteal's first blocks: worker i gets len(pending) // (workers - i)."""
    sizes = []
    for i in range(workers):
        sizes.append(total // (workers - i))
        total -= sizes[-1]
    return sizes


def longest_first(items: Sequence[pytest.Item], workers: int) -> list[pytest.Item]:
    """`items` reordered (none added, none dropped) as the module docstring says."""
    # Units: a known-long test alone, or, where a test shares a module fixture or its module is
    # keyed, its whole module.
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    units: list[tuple[float, list[pytest.Item]]] = []
    placed: set[int] = set()
    for item in items:
        if id(item) in placed:
            continue
        path = item.nodeid.split("::", 1)[0]
        seconds = _weight(item.nodeid)
        if path in SECONDS or (seconds and _uses_module_fixture(item)):
            unit = [each for each in modules[path] if id(each) not in placed]
            seconds = SECONDS.get(path, 0.0) + sum(_weight(each.nodeid) for each in unit)
        elif seconds:
            unit = [item]
        else:
            continue
        placed.update(id(each) for each in unit)
        units.append((seconds, unit))
    units.sort(key=lambda unit: -unit[0])  # stable: equal lengths keep collection order

    sizes = _block_sizes(len(items), max(1, workers))
    blocks: list[list[pytest.Item]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for seconds, unit in units:
        # The block with the least known time that still has room (the last block if none has).
        fits = [i for i in range(len(blocks)) if len(blocks[i]) + len(unit) <= sizes[i]] or [len(blocks) - 1]
        best = min(fits, key=lambda i: load[i])
        blocks[best].extend(unit)
        load[best] += seconds
    rest = iter(item for item in items if id(item) not in placed)
    for i, block in enumerate(blocks):
        while len(block) < sizes[i]:
            nxt = next(rest, None)
            if nxt is None:
                break
            block.append(nxt)
    ordered = [item for block in blocks for item in block] + list(rest)
    assert sorted(map(id, ordered)) == sorted(map(id, items))  # a reorder, nothing else
    return ordered


def workers() -> int:
    """The number of xdist workers of this run (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
