"""Behaviour-preservation check for refactors: the same inputs must export to byte-identical artifacts.

This is not a benchmark. It answers one question, "does this version of mergeflow write exactly
the bytes that an older one wrote?". One command does it all for two commits:

    python bench/export_digests.py ab REF_A REF_B [--inputs DIR] [--jobs N] [--only CASE...] [--keep]
        `git worktree add --detach` both refs in a temp dir, `pip install --no-deps --target SITE`
        each (as bench/ab_compare.py expects), build the inputs once with the CURRENT tree's
        builders (or reuse DIR when it holds cases.json), start one Prefect server, export every
        case with each site (PYTHONPATH=SITE, every mergeflow module checked to come from SITE),
        the two sides at once, N merges per side; print a table (case, files A/B, identical) and
        every difference, and exit 1 on any difference or failed merge. The worktrees and (unless
        --keep) the outputs are removed at the end.

or step by step:

    python bench/export_digests.py build INPUTS_DIR
        Build every case's tiny, real input checkpoint once, plus INPUTS_DIR/cases.json: per case
        a name and the exact `python -m mergeflow merge` argument list. Paths in it are written as
        "{inputs}/..." and resolved against INPUTS_DIR when exported.

    [PYTHONPATH=OLD_SITE] python bench/export_digests.py export INPUTS_DIR OUT_DIR DIGESTS.json [--jobs N]
        Run every case as its own `python -m mergeflow merge ... --target_dir OUT_DIR/<case>`
        subprocess (offline, a private PREFECT_HOME and schema cache per case, one shared Prefect
        server: PREFECT_API_URL's, else one started here; PYTHONPATH inherited so that an older
        mergeflow installed elsewhere can be put first), and write DIGESTS.json: case ->
        {relative file path: sha256} of every file of the output. A failed merge is printed with its
        output and makes the exit status 1. Which mergeflow the subprocesses imported is written
        beside it as DIGESTS.origin.json; --expect-mergeflow-under DIR makes a mismatch fatal.

    python bench/export_digests.py compare A.json B.json [--outputs A_OUT B_OUT]
        Print every difference (missing case, missing file, different digest) and exit 1 if there
        is any. With --outputs, differing JSON files are also diffed key by key.

What counts as "the same": every byte of every published file. The one exception is the value of
`producer.mergeflow` in each merge_manifest.json (mergeflow/formats/manifest.py producer_versions()):
when the two versions are equal the manifest must be byte-identical; when they differ, it must be
byte-identical once that one value is replaced by a placeholder (the cut is checked to change
nothing else). A manifest that lists the digest of another manifest (a pipeline's
lora_adapter/merge_manifest.json) then still differs, in that digest: the tool reports it.

The cases (`build`; inputs from the test suite's own builders, imported, never copied):
  rank-file layouts (tiny Flux, transformer output): FSDP2 W=1, 2, 4 (fake process group); HSDP 2x2
    (2-D mesh); one plain unsharded rank file; FSDP2 files labelled "FSDP_version": 1; real FSDP1
    FULL_SHARD W=3 and HYBRID_SHARD 2x2 with bf16 mixed precision (gloo processes,
    tests/fixtures/fsdp1_writers.py);
  dtypes and sharding: preserve (float32 and bfloat16 masters), bfloat16, float16, float32 (up from
    bfloat16), --max_shard_size splitting into several shards and an index;
  torch DCP (gloo, tests/fixtures/dcp_writers.py): accelerate's `model.`-prefixed save W=3 into a
    transformer and into a bfloat16 4 KiB-sharded Flux pipeline with --hf_model_config_path; a
    bfloat16 PEFT model's DCP (`base_model.model.` keys) fused and as an adapter, --adapter-config;
  every architecture of tests/test_pipelines.py CASES, pipeline output: Qwen-Image, Qwen-Image-Edit,
    Qwen-Image-Edit-Plus, SD3.5, Flux, Flux schnell, Wan2.1, Wan2.2, LTX-2; Wan2.2's transformer_2
    (--component); Boogu (remote code, --trust-remote-code); a transformer out of a pipeline base;
  MiniMax H3: the native package (converted) with --qkv-layout interleaved, and stacked in bfloat16;
    Diffusers' modular layout (unconverted);
  LoRA (tests/lora_builders.py, adapters `default` and `old`): full state as a PEFT adapter, as a
    Diffusers-format adapter (--adapter-format diffusers, --adapter-name old), fused (--fuse-lora);
    into a Flux pipeline with a PEFT adapter, a Diffusers adapter, and fused; save_lora_only with a
    Hub-id base and with a local base; Qwen-Image with a modules_to_save copy; tests/test_lora_export.py
    VARIANTS (DoRA + rsLoRA + rank/alpha patterns, lora_B biases) with --adapter-config.
Not covered, and why: uploads (--hf_upload_path: they publish the same local files first, and
need a Hub); --task-runner dask and --workers N (the same writers in another scheduler: shard
bytes do not depend on it, and a Dask cluster per run would double the time); --allow-unchanged on an
untrained checkpoint (a refusal path whose publish is an ordinary one); the LoRA conv targets of
Wan / SD3 (tests/test_lora_export.py CASES: the same adapter writer, left out for run time);
interrupted and resumed exports (tests/test_crash_recovery.py proves they resume to the same bytes).

`build` needs the current tree (it imports tests/ and mergeflow.demo); `export`, `compare` and
`ab`'s driver use only the standard library (and Prefect's CLI for the server), so the driver
itself never imports the mergeflow under test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CASES_FILE = "cases.json"
PLACEHOLDER = "{inputs}"
MERGE_TIMEOUT_S = 1800  # a tiny merge takes seconds alone, minutes on two busy cores
# Set when the run is interrupted; the merge processes running now (see stop_running).
STOP = threading.Event()
_RUNNING: set[subprocess.Popen[str]] = set()
_RUNNING_LOCK = threading.Lock()
SERVER_STARTUP_S = 300
# mergeflow/formats/manifest.py: MANIFEST_NAME, and producer_versions() under "producer", keyed by
# distribution name. Spelled out here because the driver never imports the mergeflow under test.
MANIFEST_NAME = "merge_manifest.json"
PRODUCER_KEY = "producer"
PRODUCER_FIELD = "mergeflow"
VERSION_PLACEHOLDER = "<mergeflow version>"

# A file's sha256; for a manifest {"sha256", "producer_version", "sha256_without_producer_version"}.
FileDigest = str | dict[str, Any]
Digests = dict[str, dict[str, FileDigest]]


class CaseFailed(Exception):
    """One case's merge failed (or left something behind): reported, and the run goes on with the others."""


@dataclass(frozen=True)
class Case:
    """One export: a name (its output folder) and the merge arguments, paths as "{inputs}/..."."""

    name: str
    args: list[str]
    note: str

    def resolved(self, inputs: Path) -> list[str]:
        return [arg.replace(PLACEHOLDER, str(inputs)) for arg in self.args]


# --------------------------------------------------------------------------------------------
# build


def _inputs_path(rel: str) -> str:
    return f"{PLACEHOLDER}/{rel}"


def _relative(path: Path, inputs: Path) -> str:
    return _inputs_path(path.resolve().relative_to(inputs.resolve()).as_posix())


def _bf16_bytes(model: Any) -> int:
    return sum(t.numel() * 2 for t in model.state_dict().values() if t.is_floating_point())


def build_inputs(inputs: Path) -> list[Case]:
    """Write every case's base and checkpoint under `inputs`; return the cases (not yet saved).

    Every input comes from the test suite's own builders (imported, never copied), so a layout the
    tests learn to build is one `add` away from being proven here too.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # As tests/conftest.py does (builders, fixtures.*), plus the repository root for `tests.fixtures.*`.
    sys.path[:0] = [str(REPO), str(REPO / "tests")]

    import torch
    from builders import make_export
    from lora_builders import build_lora_checkpoint
    from pipeline_builders import make_actor
    from test_lora_export import SAVED, VARIANTS, perturb_saved, plain_config
    from test_pipelines import CASES as PIPELINE_CASES

    from mergeflow.demo.checkpoints import build_transformer
    from tests.fixtures.boogu import build_boogu_pipeline, load_boogu_transformer
    from tests.fixtures.dcp_writers import write_dcp_checkpoint
    from tests.fixtures.fsdp1_writers import write_fsdp1_checkpoint
    from tests.fixtures.minimax_h3 import (
        build_minimax_h3_modular,
        build_minimax_h3_native,
    )
    from tests.fixtures.pipelines_image import build_flux_pipeline
    from tests.fixtures.pipelines_video import build_wan_pipeline

    common = ["--backend", "fsdp"]
    cases: list[Case] = []

    def add(name: str, local_dir: Path, base: Path | str, extra: Sequence[str], note: str) -> None:
        base_arg = _relative(base, inputs) if isinstance(base, Path) else base
        args = [*common, "--local_dir", _relative(local_dir, inputs), "--base_model", base_arg, *extra]
        cases.append(Case(name, args, note))
        print(f"built {name}", file=sys.stderr, flush=True)

    transformer_out = ["--output_format", "transformer"]

    # --- (a) verl FSDP rank-file layouts: tiny Flux, transformer output ------------------------------
    for world_size in (1, 2, 4):
        ex = make_export(inputs / f"fsdp2_w{world_size}", "FluxTransformer2DModel", world_size=world_size)
        add(f"fsdp2_w{world_size}", ex.actor_dir, ex.base_dir, transformer_out,
            f"FSDP2 over {world_size} rank(s) (fake process group), float32, dtype preserve")
    w4 = make_export(inputs / "fsdp2_w4_again", "FluxTransformer2DModel", world_size=4)
    shard = max(1, _bf16_bytes(w4.actor) // 5)
    add("fsdp2_w4_bf16_sharded", w4.actor_dir, w4.base_dir,
        [*transformer_out, "--dtype", "bfloat16", "--max_shard_size", str(shard)],
        f"FSDP2 W=4 cast to bfloat16, {shard}-byte shards (several shards and an index)")
    add("fsdp2_w4_fp16", w4.actor_dir, w4.base_dir, [*transformer_out, "--dtype", "float16"],
        "FSDP2 W=4 cast to float16")
    bf16 = make_export(inputs / "fsdp2_w2_bf16", "FluxTransformer2DModel", world_size=2, dtype=torch.bfloat16)
    add("fsdp2_bf16_preserve", bf16.actor_dir, bf16.base_dir, transformer_out,
        "FSDP2 W=2 trained in bfloat16, dtype preserve")
    add("fsdp2_bf16_to_fp32", bf16.actor_dir, bf16.base_dir, [*transformer_out, "--dtype", "float32"],
        "FSDP2 W=2 trained in bfloat16, written as float32")
    hsdp = make_export(inputs / "hsdp_2x2", "FluxTransformer2DModel", world_size=4, mesh_shape=(2, 2))
    add("hsdp_2x2", hsdp.actor_dir, hsdp.base_dir, transformer_out, "HSDP: 2 replicas x 2 shards (2-D mesh)")
    plain = make_export(inputs / "plain_w1", "FluxTransformer2DModel", world_size=1, plain=True)
    add("plain_w1", plain.actor_dir, plain.base_dir, transformer_out, "one unsharded rank file (plain tensors)")
    relabel = make_export(inputs / "fsdp1_label_w2", "FluxTransformer2DModel", world_size=2, fsdp_version=1)
    add("fsdp1_label_w2", relabel.actor_dir, relabel.base_dir, transformer_out,
        'FSDP2 files under fsdp_config "FSDP_version": 1')
    full = write_fsdp1_checkpoint(inputs / "fsdp1_full_w3", strategy="FULL_SHARD", world_size=3)
    add("fsdp1_full_shard_w3", full.actor_dir, full.base_dir, transformer_out,
        "real FSDP1 FULL_SHARD, 3 gloo processes, one training step")
    hybrid = write_fsdp1_checkpoint(inputs / "fsdp1_hsdp_2x2", strategy="HYBRID_SHARD", world_size=4,
                                    bf16_mixed_precision=True)
    add("fsdp1_hybrid_shard_2x2", hybrid.actor_dir, hybrid.base_dir, transformer_out,
        "real FSDP1 HYBRID_SHARD on a 2x2 device mesh, bf16 mixed precision, 4 gloo processes")

    # --- (b) torch DCP, as accelerate saves it ("model." prefix) and as a PEFT model ------------------
    dcp = write_dcp_checkpoint(inputs / "dcp_w3", world_size=3, prefix="model.")
    add("dcp_w3_transformer", dcp.dcp_dir, dcp.base_dir, transformer_out,
        "torch DCP from 3 gloo ranks, keys prefixed `model.` (accelerate)")
    dcp_pipe = build_flux_pipeline(inputs / "dcp_w3_pipeline_base", build_transformer(dcp.class_name, seed=0))
    config_dir = inputs / "dcp_w3_model_config"
    config_dir.mkdir()
    shutil.copy(dcp_pipe / "transformer" / "config.json", config_dir / "config.json")
    add("dcp_w3_pipeline_bf16_sharded", dcp.dcp_dir, dcp_pipe,
        ["--output_format", "pipeline", "--dtype", "bfloat16", "--max_shard_size", "4096",
         "--hf_model_config_path", _relative(config_dir, inputs)],
        "the same DCP into a Flux pipeline, bfloat16, 4 KiB shards, the model config from the flag")
    peft_dcp = write_dcp_checkpoint(inputs / "dcp_lora_w2", world_size=2, dtype=torch.bfloat16, lora=True)
    assert peft_dcp.adapter_config is not None
    adapter_config = ["--adapter-config", _relative(peft_dcp.adapter_config, inputs)]
    add("dcp_lora_fused", peft_dcp.dcp_dir, peft_dcp.base_dir, [*transformer_out, "--fuse-lora", *adapter_config],
        "torch DCP of a bf16 PEFT model (2 ranks), LoRA fused")
    add("dcp_lora_adapter", peft_dcp.dcp_dir, peft_dcp.base_dir, [*transformer_out, *adapter_config],
        "the same DCP, PEFT adapter exported")

    # --- (c) every architecture's tiny base pipeline, pipeline output (tests/test_pipelines.py CASES) ---
    for name, spec in sorted(PIPELINE_CASES.items()):
        root = inputs / f"pipeline_{name}"
        transformer = build_transformer(spec.transformer_class, seed=0, config_overrides=spec.overrides)
        base = spec.build(root / "base", transformer)
        _, actor_dir = make_actor(transformer, root)  # FSDP2, 2 ranks
        add(f"pipeline_{name}", actor_dir, base, [], f"tiny {spec.pipeline_class}, FSDP2 W=2, pipeline output")
        if name == "qwenimage":
            add("transformer_from_qwenimage_pipeline", actor_dir, base, transformer_out,
                "the same checkpoint, transformer output out of a pipeline base")
    wan = inputs / "pipeline_wan22_transformer_2"
    first, second = build_transformer("WanTransformer3DModel", seed=0), build_transformer("WanTransformer3DModel", seed=7)
    wan_base = build_wan_pipeline(wan / "base", first, transformer_2=second, boundary_ratio=0.9)
    _, wan_actor = make_actor(second, wan, seed=3)
    add("pipeline_wan22_transformer_2", wan_actor, wan_base, ["--component", "transformer_2"],
        "Wan2.2, the low-noise expert trained (--component transformer_2)")
    boogu = inputs / "pipeline_boogu"
    boogu_base = build_boogu_pipeline(boogu / "base")
    _, boogu_actor = make_actor(load_boogu_transformer(boogu_base), boogu)
    add("pipeline_boogu_remote_code", boogu_actor, boogu_base, ["--trust-remote-code"],
        "Boogu-Image, remote-code pipeline (.py files copied), --trust-remote-code")

    # --- (d) MiniMax H3: native package (converted, both qkv layouts) and Diffusers' modular layout ---
    h3_class = "MiniMaxH3Transformer3DModel"
    h3 = build_transformer(h3_class, seed=0)
    h3_base = build_minimax_h3_native(inputs / "minimax_h3_native" / "base", copy.deepcopy(h3))
    _, h3_actor = make_actor(h3, inputs / "minimax_h3_native")
    add("minimax_h3_native", h3_actor, h3_base, [], "MiniMax H3 into its native package, interleaved qkv")
    add("minimax_h3_native_stacked_bf16", h3_actor, h3_base, ["--qkv-layout", "stacked", "--dtype", "bfloat16"],
        "same, stacked qkv, bfloat16 (float32 modules kept)")
    modular = inputs / "minimax_h3_modular"
    h3m = build_transformer(h3_class, seed=0)
    h3m_base = build_minimax_h3_modular(modular / "base", h3m)
    index_path = h3m_base / "modular_model_index.json"  # as tests/test_minimax_h3.py: a local save's spec
    index = json.loads(index_path.read_text())
    index["transformer_ref"][2]["pretrained_model_name_or_path"] = str(h3m_base)
    index_path.write_text(json.dumps(index, indent=2))
    _, h3m_actor = make_actor(h3m, modular)
    add("minimax_h3_modular", h3m_actor, h3m_base, [], "MiniMax H3 in Diffusers' modular layout (unconverted)")

    # --- (e) LoRA: PEFT runs with adapters `default` and `old` (tests/lora_builders.py) -----------------
    flux_targets = plain_config("FluxTransformer2DModel")
    lora = build_lora_checkpoint(inputs / "flux_lora_full", "FluxTransformer2DModel", flux_targets, world_size=3)
    add("lora_peft_adapter", lora.actor_dir, lora.base_dir, transformer_out,
        "Flux LoRA full-state, 3 ranks: frozen weights + lora_adapter/ (PEFT)")
    add("lora_diffusers_adapter", lora.actor_dir, lora.base_dir,
        [*transformer_out, "--adapter-format", "diffusers", "--adapter-name", "old"],
        "same checkpoint, adapter `old` in Diffusers' LoRA format")
    add("lora_fused", lora.actor_dir, lora.base_dir, [*transformer_out, "--fuse-lora"],
        "same checkpoint with adapter `default` folded into the weights")
    lora_pipe = build_flux_pipeline(inputs / "flux_lora_pipeline_base",
                                    build_transformer("FluxTransformer2DModel", seed=0))
    add("lora_pipeline_diffusers_adapter", lora.actor_dir, lora_pipe,
        ["--output_format", "pipeline", "--adapter-format", "diffusers"],
        "same checkpoint into a Flux pipeline with lora_adapter/ in Diffusers' format")
    add("lora_pipeline_peft_adapter", lora.actor_dir, lora_pipe, ["--output_format", "pipeline"],
        "same checkpoint into a Flux pipeline with lora_adapter/ (PEFT)")
    add("lora_pipeline_fused", lora.actor_dir, lora_pipe, ["--output_format", "pipeline", "--fuse-lora"],
        "same checkpoint fused into a Flux pipeline's transformer")
    lora_only = build_lora_checkpoint(inputs / "flux_lora_only", "FluxTransformer2DModel", flux_targets,
                                      world_size=3, layout="lora_only")
    add("lora_only_adapter_hub_base", lora_only.actor_dir, "tiny-org/tiny-base", transformer_out,
        "verl save_lora_only checkpoint: adapter only, base given as a Hub id (never fetched)")
    add("lora_only_adapter_local_base", lora_only.actor_dir, lora_only.base_dir,
        [*transformer_out, "--adapter-format", "diffusers"], "the same, a local base, Diffusers' format")
    qwen = "QwenImageTransformer2DModel"
    saved = build_lora_checkpoint(inputs / "qwen_lora_saved", qwen, plain_config(qwen, SAVED[qwen]), world_size=1,
                                  mutate=perturb_saved)
    add("lora_qwenimage_modules_to_save", saved.actor_dir, saved.base_dir, transformer_out,
        "QwenImage LoRA with a modules_to_save copy of proj_out, W=1")
    for variant, (layout, world_size, make) in sorted(VARIANTS.items()):
        root = inputs / f"lora_{variant}"
        ck = build_lora_checkpoint(root, "FluxTransformer2DModel", make, world_size=world_size, layout=layout)
        ck.peft.peft_config["default"].save_pretrained(str(root / "cfg"))
        add(f"lora_{variant}", ck.actor_dir, ck.base_dir,
            [*transformer_out, "--adapter-config", _relative(root / "cfg" / "adapter_config.json", inputs)],
            f"{variant} ({layout}, W={world_size}) with its PEFT adapter_config.json")
    return cases


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cmd_build(inputs: Path) -> int:
    if inputs.exists() and any(inputs.iterdir()):
        raise SystemExit(f"{inputs} exists and is not empty: inputs are built once, into a new directory")
    inputs.mkdir(parents=True, exist_ok=True)
    cases = build_inputs(inputs)
    import torch

    doc = {
        "note": f"args of `python -m mergeflow merge`; {PLACEHOLDER} is this directory; "
                "--target_dir is added per run",
        "built_by": {"commit": _git_head(), "torch": torch.__version__},
        "cases": [{"name": c.name, "args": c.args, "note": c.note} for c in cases],
    }
    (inputs / CASES_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({"inputs": str(inputs), "cases": [c.name for c in cases]}))
    return 0


# --------------------------------------------------------------------------------------------
# export


def load_cases(inputs: Path) -> list[Case]:
    doc = json.loads((inputs / CASES_FILE).read_text())
    cases = [Case(str(c["name"]), [str(a) for a in c["args"]], str(c.get("note", ""))) for c in doc["cases"]]
    names = [c.name for c in cases]
    if len(set(names)) != len(names) or any(not n or "/" in n or n.startswith(".") for n in names):
        raise SystemExit(f"{inputs / CASES_FILE}: case names must be unique plain folder names, got {names}")
    return cases


def child_env(scratch: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one CLI run: offline, private Prefect home and schema cache, PYTHONPATH kept.

    `extra` (PYTHONPATH, PREFECT_API_URL of a shared server) is laid over the inherited environment.
    Without a PREFECT_API_URL each run would start its own temporary Prefect server (slow, and on a
    loaded machine it may miss its startup deadline): `export` starts one server for all its runs.
    """
    env = dict(os.environ)
    env.update(extra or {})
    prefect_home = scratch / "prefect_home"
    cache = scratch / "mergeflow_cache"
    prefect_home.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MERGEFLOW_LOCAL_SERVER": "0",
        "PREFECT_HOME": str(prefect_home),
        "MERGEFLOW_CACHE_DIR": str(cache),
    })
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def prefect_server(scratch: Path) -> Iterator[dict[str, str]]:
    """The environment that points a child at a Prefect server: PREFECT_API_URL if set, else one started here.

    Started with Prefect's own CLI (not mergeflow's local-server helper), so the driver depends on no
    mergeflow module that a refactor may move; stopped (its process group) at the end.
    """
    if os.environ.get("PREFECT_API_URL"):
        yield {"PREFECT_API_URL": os.environ["PREFECT_API_URL"]}
        return
    home = scratch / "prefect_server"
    home.mkdir()
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_UI_API_URL": api_url,
                # as mergeflow's local server: back-to-back flow runs do not wait on the task-run recorder
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1"})
    log = (home / "server.log").open("ab")
    process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                "--port", str(port), "--analytics-off", "--no-ui"], env=env, cwd=home,
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_STARTUP_S
        while not _healthy(api_url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Prefect server did not start; see {home / 'server.log'}")
            time.sleep(0.5)
        print(f"Prefect server {api_url} (pid {process.pid})", file=sys.stderr, flush=True)
        yield {"PREFECT_API_URL": api_url}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


# Imports every module of the mergeflow that the child finds (skipping `__main__`; whatever its subpackages
# are called: a `--target` install holds them all under mergeflow/), then lists where each mergeflow.*
# module came from: a subpackage missing from an install must not quietly come from elsewhere (a
# setuptools editable finder, for one, serves any mergeflow.* name that the install lacks).
_PROBE = """\
import importlib, importlib.util, json, pkgutil, sys
import mergeflow
from importlib import metadata
errors = {}
def load(name):
    try:
        importlib.import_module(name)
    except Exception as err:
        errors[name] = f"{type(err).__name__}: {err}"
# the console script's module first: an editable install maps some subpackages outside mergeflow/
for entry in metadata.distribution("mergeflow").entry_points:
    load(entry.module)
walked, more = set(), True
while more:  # every package imported so far, walked, until no new package appears
    more = False
    for name, module in list(sys.modules.items()):
        if (name == "mergeflow" or name.startswith("mergeflow.")) and hasattr(module, "__path__") and name not in walked:
            walked.add(name)
            more = True
            for info in pkgutil.walk_packages(module.__path__, name + ".", onerror=lambda name: None):
                if info.name.rsplit(".", 1)[-1] != "__main__":
                    load(info.name)
files = {name: getattr(module, "__file__", None) for name, module in sorted(sys.modules.items())
         if name == "mergeflow" or name.startswith("mergeflow.")}
main = importlib.util.find_spec("mergeflow.__main__")
print(json.dumps({"mergeflow": mergeflow.__file__, "mergeflow.__main__": main.origin if main else None,
                  "version": metadata.version("mergeflow"),
                  "dist_info": str(metadata.distribution("mergeflow")._path),
                  "module_files": files, "import_errors": errors}))
"""


def probe_origin(scratch: Path, extra: Mapping[str, str]) -> dict[str, Any]:
    """Which mergeflow a child with this environment and working directory imports, module by module."""
    work = scratch / "probe"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=work, env=child_env(work, extra), check=False, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"cannot import mergeflow in the child environment:\n{done.stderr}")
    origin: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    origin["PYTHONPATH"] = extra.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    origin["python"] = sys.executable
    return origin


def check_origin(origin: dict[str, Any], expect_under: Path) -> None:
    """Fail unless every mergeflow module the child imported lies under `expect_under`, and all imported."""
    root = expect_under.resolve()
    files: dict[str, str | None] = origin["module_files"]
    foreign = {name: file for name, file in files.items() if file is None or not Path(file).resolve().is_relative_to(root)}
    if foreign:
        raise SystemExit(f"mergeflow modules from outside {root}: {json.dumps(foreign, indent=1)}")
    if origin["import_errors"]:
        raise SystemExit(f"mergeflow modules that do not import: {json.dumps(origin['import_errors'], indent=1)}")


def _summary(origin: dict[str, Any]) -> str:
    brief = {k: v for k, v in origin.items() if k not in ("module_files", "import_errors")}
    brief["modules"] = len(origin["module_files"])
    brief["import_errors"] = len(origin["import_errors"])
    return json.dumps(brief)


def run_case(case: Case, inputs: Path, out_dir: Path, scratch: Path, extra: Mapping[str, str]) -> Path:
    """Run one case's merge command; raise CaseFailed with its output if it fails."""
    target = out_dir / case.name
    work = scratch / case.name
    work.mkdir()
    # A neutral working directory: `python -m` puts it first on sys.path, and the repository root
    # would shadow the mergeflow that PYTHONPATH selects.
    command = [sys.executable, "-m", "mergeflow", "merge", *case.resolved(inputs), "--target_dir", str(target)]
    if STOP.is_set():
        raise CaseFailed(f"[{case.name}] not run: the export was interrupted")
    print(f"[{case.name}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    with subprocess.Popen(command, cwd=work, env=child_env(work, extra), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        with _RUNNING_LOCK:
            _RUNNING.add(process)
        try:
            stdout, stderr = process.communicate(timeout=MERGE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            stderr += f"\n(killed after {MERGE_TIMEOUT_S} s)"
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(process)
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if done.returncode != 0:
        raise CaseFailed(
            f"[{case.name}] merge exited {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}\n"
            f"--- stderr ---\n{done.stderr[-8000:]}"
        )
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise CaseFailed(f"[{case.name}] the last stdout line is not the result JSON:\n{done.stdout[-4000:]}") from None
    if Path(result["output_dir"]).resolve() != target.resolve() or not target.is_dir():
        raise CaseFailed(f"[{case.name}] expected output in {target}, the command said {result}")
    # Staging and lock entries are ".<target>.*" (other cases may be running beside it: only its own count).
    left = sorted(p.name for p in out_dir.iterdir() if p.name.startswith(f".{case.name}."))
    if left:
        raise CaseFailed(f"[{case.name}] the export left entries beside its target: {left}")
    return target


def stop_running() -> None:
    """Interrupted: no queued case starts, and the running merges are terminated (their staging is theirs to keep)."""
    STOP.set()
    with _RUNNING_LOCK:
        for process in _RUNNING:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()


def _on_sigterm(*_: object) -> None:
    stop_running()
    sys.exit(143)


def _files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def without_producer_version(raw: bytes) -> tuple[str | None, bytes]:
    """A manifest's `producer.mergeflow` version, and its bytes with only that value replaced by a placeholder.

    Everything else stays byte for byte (indent, key order, other producer versions). The cut is
    checked: the result must parse to the manifest with exactly that one value changed. A manifest
    without the field (or not JSON) comes back unchanged, with version None.
    """
    try:
        data = json.loads(raw)
        version = data[PRODUCER_KEY][PRODUCER_FIELD]
    except (ValueError, TypeError, KeyError):
        return None, raw
    if not isinstance(version, str):
        return None, raw
    text = raw.decode("utf-8")
    producers = list(re.finditer(rf'"{PRODUCER_KEY}"\s*:\s*\{{', text))
    if len(producers) != 1:
        raise SystemExit(f'manifest: expected one "{PRODUCER_KEY}" object, found {len(producers)}')
    field = re.compile(rf'("{PRODUCER_FIELD}"\s*:\s*){re.escape(json.dumps(version))}')
    match = field.search(text, producers[0].end())
    if match is None:
        raise SystemExit(f'manifest: "{PRODUCER_KEY}.{PRODUCER_FIELD}" not found where expected')
    cut = text[:match.start()] + match.group(1) + json.dumps(VERSION_PLACEHOLDER) + text[match.end():]
    expected = copy.deepcopy(data)
    expected[PRODUCER_KEY][PRODUCER_FIELD] = VERSION_PLACEHOLDER
    if json.loads(cut) != expected:
        raise SystemExit(f'manifest: cutting "{PRODUCER_KEY}.{PRODUCER_FIELD}" changed something else')
    return version, cut.encode("utf-8")


def file_digest(path: Path) -> FileDigest:
    """sha256 of a file; for a manifest also its producer version and the sha256 without that version."""
    if path.name != MANIFEST_NAME:
        return sha256_file(path)
    raw = path.read_bytes()
    version, cut = without_producer_version(raw)
    return {"sha256": sha256_bytes(raw), "producer_version": version, "sha256_without_producer_version": sha256_bytes(cut)}


def tree_digests(root: Path) -> dict[str, FileDigest]:
    """Relative POSIX path -> digest of every file under `root` (links are refused, not followed)."""
    out: dict[str, FileDigest] = {}
    for path in _files(root):
        if path.is_symlink() or not path.is_file():
            raise SystemExit(f"{path}: not a plain file")
        out[path.relative_to(root).as_posix()] = file_digest(path)
    return out


def _select(cases: list[Case], only: Sequence[str]) -> list[Case]:
    if not only:
        return cases
    unknown = sorted(set(only) - {c.name for c in cases})
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}")
    return [c for c in cases if c.name in only]


def export_all(inputs: Path, out_dir: Path, expect_under: Path | None, only: Sequence[str],
               extra: Mapping[str, str], jobs: int = 1) -> tuple[Digests, dict[str, Any]]:
    """Export every selected case into out_dir/<case> with the mergeflow that `extra`'s PYTHONPATH selects.

    `jobs` merges run at once (each its own process, target and scratch; the first failure ends the run).
    """
    inputs = inputs.resolve()
    cases = _select(load_cases(inputs), only)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"{out_dir} exists and is not empty: every target must be new")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    scratch = Path(tempfile.mkdtemp(prefix="mergeflow-digests-"))
    try:
        origin = probe_origin(scratch, extra)
        print(f"mergeflow under test: {_summary(origin)}", file=sys.stderr, flush=True)
        if expect_under is not None:
            check_origin(origin, expect_under)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
        try:
            futures = {case.name: pool.submit(run_case, case, inputs, out_dir, scratch, extra) for case in cases}
            digests: Digests = {}
            failures: dict[str, str] = {}
            for name, future in futures.items():
                try:
                    digests[name] = tree_digests(future.result())
                except CaseFailed as err:
                    print(err, file=sys.stderr, flush=True)
                    failures[name] = str(err).splitlines()[-1][:300]
                print(f"[{name}] {'FAILED' if name in failures else 'done'}", file=sys.stderr, flush=True)
        except BaseException:
            stop_running()  # before the pool waits: nothing queued starts, the running merges end
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # interrupted: the queued cases never start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    origin["failed_cases"] = failures
    return digests, origin


def _write_digests(digests: Digests, origin: dict[str, Any], digests_path: Path, inputs: Path, out_dir: Path) -> None:
    digests_path.write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
    origin_path = digests_path.with_name(f"{digests_path.stem}.origin.json")
    origin_path.write_text(json.dumps({"origin": origin, "inputs": str(inputs.resolve()), "out_dir": str(out_dir)},
                                      indent=2) + "\n")


def cmd_export(inputs: Path, out_dir: Path, digests_path: Path, expect_under: Path | None, only: list[str],
               jobs: int) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="mergeflow-digests-server-"))
    try:
        with prefect_server(scratch) as server:
            digests, origin = export_all(inputs, out_dir, expect_under, only, server, jobs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _write_digests(digests, origin, digests_path, inputs, out_dir)
    failed = origin["failed_cases"]
    print(json.dumps({"digests": str(digests_path), "cases": len(digests),
                      "files": sum(len(v) for v in digests.values()), "failed": sorted(failed)}))
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# compare


def _json_diffs(a: Any, b: Any, where: str = "") -> Iterator[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            here = f"{where}.{key}" if where else str(key)
            if key not in b:
                yield f"{here}: only in A ({json.dumps(a[key])[:200]})"
            elif key not in a:
                yield f"{here}: only in B ({json.dumps(b[key])[:200]})"
            else:
                yield from _json_diffs(a[key], b[key], here)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _json_diffs(x, y, f"{where}[{i}]")
    elif a != b:
        yield f"{where or '<root>'}: A={json.dumps(a)[:200]} B={json.dumps(b)[:200]}"


def file_difference(a: FileDigest, b: FileDigest) -> str | None:
    """Why two files' digests differ, or None when they are the same bytes (producer version aside).

    Manifests with the same producer version must be byte-identical; with different versions,
    byte-identical once that one value is cut out. Anything else must be byte-identical.
    """
    if isinstance(a, str) or isinstance(b, str):
        sa = a if isinstance(a, str) else a["sha256"]
        sb = b if isinstance(b, str) else b["sha256"]
        return None if sa == sb else f"sha256 differs (A {sa[:12]}, B {sb[:12]})"
    if a["producer_version"] == b["producer_version"]:
        if a["sha256"] == b["sha256"]:
            return None
        return f"sha256 differs (A {a['sha256'][:12]}, B {b['sha256'][:12]}; same producer version)"
    if a["sha256_without_producer_version"] == b["sha256_without_producer_version"]:
        return None
    return (f"differs beyond the producer version ({a['producer_version']} vs {b['producer_version']}; "
            f"A {a['sha256_without_producer_version'][:12]}, B {b['sha256_without_producer_version'][:12]})")


def compare_case(case: str, fa: dict[str, FileDigest], fb: dict[str, FileDigest],
                 outputs: tuple[Path, Path] | None = None) -> list[str]:
    """Every difference between two exports of one case, one line each (key-level JSON diffs if outputs)."""
    lines: list[str] = []
    for rel in sorted(set(fa) | set(fb)):
        if rel not in fb:
            lines.append(f"{case}/{rel}: only in A")
        elif rel not in fa:
            lines.append(f"{case}/{rel}: only in B")
        elif (why := file_difference(fa[rel], fb[rel])) is not None:
            lines.append(f"{case}/{rel}: {why}")
            if outputs is not None and rel.endswith(".json"):
                try:
                    ja = json.loads((outputs[0] / case / rel).read_text())
                    jb = json.loads((outputs[1] / case / rel).read_text())
                except (OSError, json.JSONDecodeError) as err:
                    lines.append(f"    (cannot diff the JSON: {err})")
                else:
                    diffs = list(_json_diffs(ja, jb))
                    lines.extend(f"    {d}" for d in diffs or ["(same JSON values: the bytes differ in layout)"])
    return lines


def compare_digests(a: Digests, b: Digests, outputs: tuple[Path, Path] | None = None) -> list[str]:
    """Every difference between two digest maps, one line each."""
    lines: list[str] = []
    for case in sorted(set(a) | set(b)):
        if case not in b:
            lines.append(f"{case}: case only in A")
        elif case not in a:
            lines.append(f"{case}: case only in B")
        else:
            lines.extend(compare_case(case, a[case], b[case], outputs))
    return lines


def case_table(a: Digests, b: Digests, failed: Mapping[str, Mapping[str, str]] | None = None) -> tuple[list[str], bool]:
    """A per-case table (case, files in A / B, identical yes/no) and whether every case is identical.

    failed: side ("A", "B") -> case -> why its merge failed; such a case is never identical.
    """
    failed = failed or {}
    names = set(a) | set(b) | {case for side in failed.values() for case in side}
    width = max([len(c) for c in names] + [4])
    rows = [f"{'case':<{width}}  {'files A/B':>9}  identical"]
    same = True
    for case in sorted(names):
        fa, fb = a.get(case), b.get(case)
        broken = [side for side in ("A", "B") if case in failed.get(side, {})]
        ok = not broken and fa is not None and fb is not None and not compare_case(case, fa, fb)
        same = same and ok
        count = f"{len(fa) if fa is not None else '-'}/{len(fb) if fb is not None else '-'}"
        verdict = "yes" if ok else f"NO (merge failed with {' and '.join(broken)})" if broken else "NO"
        rows.append(f"{case:<{width}}  {count:>9}  {verdict}")
    return rows, same


def cmd_compare(a_path: Path, b_path: Path, outputs: list[Path] | None) -> int:
    a: Digests = json.loads(a_path.read_text())
    b: Digests = json.loads(b_path.read_text())
    pair = (outputs[0], outputs[1]) if outputs else None
    lines = compare_digests(a, b, pair)
    for line in lines:
        print(line)
    files = sum(len(v) for v in a.values())
    if lines:
        print(f"DIFFERENT: {sum(1 for x in lines if not x.startswith('    '))} difference(s) "
              f"({a_path} vs {b_path})")
        return 1
    print(f"IDENTICAL: {len(a)} cases, {files} files ({a_path} vs {b_path})")
    return 0


# --------------------------------------------------------------------------------------------
# ab


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def install_ref(ref: str, sha: str, root: Path) -> Path:
    """A detached worktree of `sha` under root/worktree, `pip install --no-deps --target` into root/site."""
    worktree, site = root / "worktree", root / "site"
    root.mkdir()
    _git("worktree", "add", "--detach", str(worktree), sha)
    print(f"[{ref}] {sha[:12]}: pip install --no-deps --target {site}", file=sys.stderr, flush=True)
    # Offline when this Python can build the wheel itself; else pip fetches setuptools and wheel to build it.
    isolation = [] if importlib.util.find_spec("wheel") is None else ["--no-build-isolation"]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation,
                           "--no-compile", "--target", str(site), str(worktree)], check=False, capture_output=True, text=True,
                          cwd=root, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if done.returncode != 0:
        raise SystemExit(f"[{ref}] pip install failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return site


def cmd_ab(ref_a: str, ref_b: str, inputs: Path | None, only: list[str], keep: bool, jobs: int) -> int:
    started = time.monotonic()
    shas = {ref: _git("rev-parse", "--verify", f"{ref}^{{commit}}") for ref in (ref_a, ref_b)}
    scratch = Path(tempfile.mkdtemp(prefix="mergeflow-ab-digests-"))
    roots = {"A": scratch / "A", "B": scratch / "B"}
    try:
        sites = {"A": install_ref(ref_a, shas[ref_a], roots["A"]), "B": install_ref(ref_b, shas[ref_b], roots["B"])}
        if inputs is None or not (inputs / CASES_FILE).is_file():
            inputs = inputs if inputs is not None else scratch / "inputs"
            cmd_build(inputs)  # with the current tree's builders, once for both sides
        digests: dict[str, Digests] = {}
        failed: dict[str, dict[str, str]] = {}

        def export_side(side: str, server: Mapping[str, str]) -> None:
            ref = ref_a if side == "A" else ref_b
            print(f"--- {side}: {ref} ({shas[ref][:12]}) from {sites[side]}", file=sys.stderr, flush=True)
            digests[side], origin = export_all(inputs, roots[side] / "out", sites[side], only,
                                               {**server, "PYTHONPATH": str(sites[side])}, jobs)
            failed[side] = origin["failed_cases"]
            _write_digests(digests[side], origin, roots[side] / "digests.json", inputs, roots[side] / "out")

        with prefect_server(scratch) as server, concurrent.futures.ThreadPoolExecutor(2) as sides:
            try:
                for done in [sides.submit(export_side, side, server) for side in ("A", "B")]:
                    done.result()  # both sides at once, so machine noise hits them alike
            except BaseException:
                stop_running()  # before the pool waits for the other side
                raise
        rows, same = case_table(digests["A"], digests["B"], failed)
        print(f"A = {ref_a} ({shas[ref_a][:12]}), B = {ref_b} ({shas[ref_b][:12]}), inputs {inputs}")
        print("\n".join(rows))
        lines = compare_digests(digests["A"], digests["B"], (roots["A"] / "out", roots["B"] / "out"))
        print("\n".join(lines))
        cases, files = len(rows) - 1, sum(len(v) for v in digests["A"].values())
        verdict = "IDENTICAL" if same and not lines else "DIFFERENT"
        print(f"{verdict}: {cases} cases, {files} files (A), {time.monotonic() - started:.0f} s")
        return 0 if verdict == "IDENTICAL" else 1
    finally:
        for root in roots.values():
            if (root / "worktree").exists():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(root / "worktree")],
                               check=False, capture_output=True)
        _git("worktree", "prune")
        if keep:
            print(f"kept {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the input checkpoints and cases.json once")
    build.add_argument("inputs", type=Path)
    export = sub.add_parser("export", help="export every case and write the output digests")
    export.add_argument("inputs", type=Path)
    export.add_argument("out_dir", type=Path)
    export.add_argument("digests", type=Path)
    export.add_argument("--expect-mergeflow-under", type=Path, default=None,
                        help="fail unless every mergeflow module the children import lies under this dir (and all import)")
    export.add_argument("--only", nargs="+", default=[], help="export only these cases")
    export.add_argument("--jobs", type=int, default=1, help="merges run at once (default 1)")
    compare = sub.add_parser("compare", help="compare two digest files; exit 1 on any difference")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.add_argument("--outputs", nargs=2, type=Path, metavar=("A_OUT", "B_OUT"),
                         help="the two export OUT_DIRs, to diff differing JSON files key by key")
    ab = sub.add_parser("ab", help="install two commits, export every case with each, compare; exit 1 on any difference")
    ab.add_argument("ref_a")
    ab.add_argument("ref_b")
    ab.add_argument("--inputs", type=Path, default=None,
                    help="inputs built earlier (reused if it holds cases.json, else built there); default: a temp dir")
    ab.add_argument("--only", nargs="+", default=[], help="export only these cases")
    ab.add_argument("--jobs", type=int, default=2, help="merges run at once per side; the sides run together (default 2)")
    ab.add_argument("--keep", action="store_true", help="keep the outputs and digests (the worktrees are removed)")
    args = parser.parse_args(argv)
    if args.command in ("export", "ab"):
        # SIGTERM unwinds like Ctrl-C: the Prefect server, the worktrees and the scratch go with it.
        signal.signal(signal.SIGTERM, _on_sigterm)
    if args.command == "build":
        return cmd_build(args.inputs)
    try:
        return _dispatch(args)
    except BaseException:  # Ctrl-C, SIGTERM, a failure: the other side's and the queued merges stop too
        stop_running()
        raise


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "export":
        return cmd_export(args.inputs, args.out_dir, args.digests, args.expect_mergeflow_under, args.only, args.jobs)
    if args.command == "ab":
        return cmd_ab(args.ref_a, args.ref_b, args.inputs, args.only, args.keep, args.jobs)
    return cmd_compare(args.a, args.b, args.outputs)


if __name__ == "__main__":
    sys.exit(main())
