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

# Seconds (setup + call + teardown) of one run of the whole suite, two xdist workers on the two-core
# machine (2026-12-08, a per-test probe; the loop of 10^7 additions: 0.5 s); only their relative size
# matters. A key is a test's node id (its parametrized ids included, or without them: each of them that
# long) or a module's path (its tests as one block).
SECONDS: dict[str, float] = {
    "tests/test_cluster.py": 88,  # one module-scoped cluster; ~30 s of it is a wait for missing heartbeats
    "tests/test_serve.py::test_event_and_watcher_start_merges_validate_and_backfill_run_alone": 39,
    "tests/test_serve_startup.py::test_serve_watch_and_backfill_without_an_api_url_share_the_local_server": 24,
    "tests/test_dcp.py": 21,  # module fixtures: a real gloo DCP, a bf16 PEFT DCP
    "tests/test_local_server.py::test_second_merge_reuses_the_background_server": 19,
    "tests/test_serve.py::test_sigterm_stops_a_served_runs_writers_between_tensors": 18,
    "tests/test_ui_browser.py::test_printed_links_open_the_run_in_a_browser": 17,
    "tests/test_cli.py::test_demo_leads_somewhere": 16,
    "tests/test_local_server.py::test_the_command_server_prints_no_link_and_a_users_server_its_own_ui": 14,
    "tests/test_interrupts.py::test_ctrl_c_without_a_server_is_one_line_too": 13,
    "tests/test_single_file_flux.py::test_from_single_file_reads_the_bfl_file_back_bit_for_bit": 11,  # each
    "tests/test_pipelines.py": 12,
    "tests/test_resume.py::test_dask_local_cluster_gives_a_byte_identical_artifact": 12,
    "tests/test_fsdp1.py": 11,  # module fixtures: real FSDP1 checkpoints per sharding strategy
    "tests/test_comfyui_lora.py::test_flux_fused_modules_hold_the_exact_block_structured_lora": 11,
    "tests/test_resume.py::test_merge_killed_mid_write_resumes_byte_identical": 11,
    "tests/test_serve.py::test_a_malformed_served_event_is_a_failed_run_with_its_reason": 9,
    "tests/test_local_server.py::test_a_server_whose_ui_asks_another_port_is_replaced": 9,
    "tests/test_reads_once.py::test_a_transformer_export_opens_each_metadata_file_once": 9,
    "tests/test_interrupts.py::test_sigterm_stops_the_writers_between_tensors": 8,
    "tests/test_progress.py::test_prefect_s_telemetry_notice_comes_before_the_progress_never_inside_it": 8,
    "tests/test_comfyui_lora.py::test_flux_single_block_linear1_loads_with_load_lora_weights_at_flux1_width": 7,
    "tests/test_interrupts.py::test_an_interrupted_export_ends_with_one_line_and_resumes": 6,
    "tests/test_crash_recovery.py::test_a_kill_at_every_durable_write_resumes_to_the_same_bytes": 5,  # each
    "tests/test_reads_once.py::test_a_dcp_pipeline_export_opens_each_metadata_file_once": 6,
    "tests/test_disk_full.py::test_enospc_at_every_durable_write_is_one_error_and_resumes": 6,
    "tests/test_extract_lora.py::test_the_command_line_extracts_a_diffusers_lora_that_load_lora_weights_reproduces": 5,
    "tests/test_serve.py::test_prefect_yaml_deploys_with_prefect_deploy_all": 5,
    "tests/test_resume.py::test_retry_of_the_same_flow_run_reuses_shards": 4,
}


# Session fixtures that each worker starts on first use, and that are worth starting once per run: every
# test that needs one is dealt to the same block, as one unit, so that only that block's worker starts it.
# The server that stores events (tests/conftest.py): ~4 CPU-s to start, then ~0.025 CPU-s a second of
# polling while it idles until the session ends, ~11 CPU-s a run for a second copy.
ONE_WORKER = ("prefect_events_server",)


def _weight(nodeid: str) -> float:
    """The known seconds of one test: its own entry, or its entry without the parametrized ids."""
    return SECONDS.get(nodeid, SECONDS.get(nodeid.split("[", 1)[0], 0.0))


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return any(d.scope in ("module", "class", "package") for each in defs.values() for d in each)


def _closure(item: pytest.Item) -> tuple[str, ...]:
    """The names of every fixture a test needs, those its fixtures need included."""
    info = getattr(item, "_fixtureinfo", None)
    return tuple(getattr(info, "names_closure", ())) if info is not None else ()


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
    for fixture in ONE_WORKER:
        unit, keyed = [], 0.0
        for item in items:
            if id(item) in placed or fixture not in _closure(item):
                continue
            path = item.nodeid.split("::", 1)[0]
            if path in SECONDS or _uses_module_fixture(item):  # its module's fixture is still built once
                members = [each for each in modules[path] if id(each) not in placed]
                keyed += SECONDS.get(path, 0.0)
            else:
                members = [item]
            placed.update(id(each) for each in members)
            unit.extend(members)
        if unit:
            units.append((keyed + sum(_weight(each.nodeid) for each in unit), unit))
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
