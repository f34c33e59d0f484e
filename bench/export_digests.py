"""Behaviour-preservation check for refactors: the same inputs must export to byte-identical artifacts.

This is not a benchmark: nothing here is timed. It answers one question, "does this version of
mergeflow write exactly the bytes that an older one wrote?", with three steps:

    python bench/export_digests.py build INPUTS_DIR
        Build a handful of tiny, real input checkpoints once (FSDP2 rank files written by the
        test fixture builders in tests/ and mergeflow.demo.checkpoints), plus INPUTS_DIR/cases.json:
        per case a name and the exact `python -m mergeflow merge` argument list. Paths in it are
        written as "{inputs}/..." and resolved against INPUTS_DIR when exported.

    [PYTHONPATH=OLD_SITE] python bench/export_digests.py export INPUTS_DIR OUT_DIR DIGESTS.json
        Run every case as its own `python -m mergeflow merge ... --target_dir OUT_DIR/<case>`
        subprocess (offline, a private PREFECT_HOME and schema cache per case, PYTHONPATH
        inherited so that an older mergeflow installed elsewhere can be put first), fail loudly on
        any non-zero exit, and write DIGESTS.json: case -> {relative file path: sha256} of every
        file of the output. Which mergeflow the subprocesses imported is printed and written
        beside it as DIGESTS.origin.json; --expect-mergeflow-under DIR makes a mismatch fatal.

    python bench/export_digests.py compare A.json B.json [--outputs A_OUT B_OUT]
        Print every difference (missing case, missing file, different digest) and exit 1 if there
        is any. With --outputs, differing JSON files are also diffed key by key.

`build` needs the current tree (it imports tests/ and mergeflow.demo); `export` and `compare` use
only the standard library, so the driver itself never imports the mergeflow under test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CASES_FILE = "cases.json"
PLACEHOLDER = "{inputs}"
MERGE_TIMEOUT_S = 600

Digests = dict[str, dict[str, str]]


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
    """Write every case's base and checkpoint under `inputs`; return the cases (not yet saved)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.path.insert(0, str(REPO / "tests"))  # as tests/conftest.py does: builders, fixtures.*

    import copy

    from builders import make_export
    from fixtures.minimax_h3 import build_minimax_h3_native
    from fixtures.pipelines_image import build_qwenimage_pipeline, build_sd3_pipeline
    from lora_builders import ATTN_TARGETS, build_lora_checkpoint
    from peft import LoraConfig
    from pipeline_builders import make_actor

    from mergeflow.demo.checkpoints import build_transformer

    common = ["--backend", "fsdp"]
    cases: list[Case] = []

    def add(name: str, local_dir: Path, base: Path | str, extra: Sequence[str], note: str) -> None:
        base_arg = _relative(base, inputs) if isinstance(base, Path) else base
        args = [*common, "--local_dir", _relative(local_dir, inputs), "--base_model", base_arg, *extra]
        cases.append(Case(name, args, note))
        print(f"built {name}", file=sys.stderr, flush=True)

    # (a) + (b): a tiny Flux transformer, FSDP2 over 4 ranks, float32 masters.
    flux = make_export(inputs / "flux_fsdp2_w4", "FluxTransformer2DModel", world_size=4)
    add("flux_transformer_fp32", flux.actor_dir, flux.base_dir, ["--output_format", "transformer"],
        "tiny Flux, FSDP2 4 ranks, float32, transformer output")
    shard = max(1, _bf16_bytes(flux.actor) // 5)
    add("flux_transformer_bf16_sharded", flux.actor_dir, flux.base_dir,
        ["--output_format", "transformer", "--dtype", "bfloat16", "--max_shard_size", str(shard)],
        f"same checkpoint cast to bfloat16, {shard}-byte shards (several shards and an index)")

    # (c): full pipeline exports (every base file copied, the transformer replaced).
    for name, class_name, build_pipeline in (
        ("sd3_pipeline", "SD3Transformer2DModel", build_sd3_pipeline),
        ("qwenimage_pipeline", "QwenImageTransformer2DModel", build_qwenimage_pipeline),
    ):
        root = inputs / name
        transformer = build_transformer(class_name, seed=0)
        base = build_pipeline(root / "base", transformer)
        _, actor_dir = make_actor(transformer, root)  # FSDP2, 2 ranks
        add(name, actor_dir, base, [], f"tiny {class_name} in its pipeline, pipeline output")

    # (d): a PEFT LoRA run (adapters `default` and `old`) with the full state saved, and a LoRA-only save.
    targets = [*ATTN_TARGETS, "proj_mlp"]

    def lora_config(_: str) -> LoraConfig:
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets)

    lora = build_lora_checkpoint(inputs / "flux_lora_full", "FluxTransformer2DModel", lora_config, world_size=3)
    add("flux_lora_peft_adapter", lora.actor_dir, lora.base_dir, ["--output_format", "transformer"],
        "Flux LoRA full-state, 3 ranks: frozen weights + lora_adapter/ (PEFT)")
    add("flux_lora_diffusers_adapter", lora.actor_dir, lora.base_dir,
        ["--output_format", "transformer", "--adapter-format", "diffusers", "--adapter-name", "old"],
        "same checkpoint, adapter `old` in Diffusers' LoRA format")
    add("flux_lora_fused", lora.actor_dir, lora.base_dir, ["--output_format", "transformer", "--fuse-lora"],
        "same checkpoint with adapter `default` folded into the weights")
    lora_only = build_lora_checkpoint(inputs / "flux_lora_only", "FluxTransformer2DModel", lora_config,
                                      world_size=3, layout="lora_only")
    add("flux_lora_only_adapter", lora_only.actor_dir, "tiny-org/tiny-base", ["--output_format", "transformer"],
        "verl save_lora_only checkpoint: adapter only, base given as a Hub id (never fetched)")

    # (e): MiniMax H3 trained in Diffusers' layout, exported into a native package (converted).
    h3_root = inputs / "minimax_h3_native"
    h3 = build_transformer("MiniMaxH3Transformer3DModel", seed=0)
    h3_base = build_minimax_h3_native(h3_root / "base", copy.deepcopy(h3))
    _, h3_actor = make_actor(h3, h3_root)
    add("minimax_h3_native", h3_actor, h3_base, [], "MiniMax H3 into its native package, interleaved qkv")
    add("minimax_h3_native_stacked_bf16", h3_actor, h3_base, ["--qkv-layout", "stacked", "--dtype", "bfloat16"],
        "same, stacked qkv, bfloat16 (float32 modules kept)")
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


def child_env(scratch: Path) -> dict[str, str]:
    """The environment of one CLI run: offline, private Prefect home and schema cache, PYTHONPATH kept."""
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)  # each run starts its own temporary server
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


# Imports every module of the mergeflow that the child finds (skipping `__main__`), then lists where each
# mergeflow.* module came from: a subpackage missing from an install must not quietly come from elsewhere
# (a setuptools editable finder, for one, serves any mergeflow.* name that the install lacks).
_PROBE = """\
import importlib, json, pkgutil, sys
import mergeflow, mergeflow.tasks, mergeflow.flows, mergeflow.deployments
from importlib import metadata
errors = {}
for package in (mergeflow, mergeflow.tasks, mergeflow.flows, mergeflow.deployments):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=lambda name: None):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except Exception as err:
            errors[info.name] = f"{type(err).__name__}: {err}"
files = {name: getattr(module, "__file__", None) for name, module in sorted(sys.modules.items())
         if name == "mergeflow" or name.startswith("mergeflow.")}
print(json.dumps({"mergeflow": mergeflow.__file__, "mergeflow.tasks": mergeflow.tasks.__file__,
                  "mergeflow.flows.cli": importlib.import_module("mergeflow.flows.cli").__file__,
                  "version": metadata.version("mergeflow"),
                  "dist_info": str(metadata.distribution("mergeflow")._path),
                  "module_files": files, "import_errors": errors}))
"""


def probe_origin(scratch: Path) -> dict[str, Any]:
    """Which mergeflow a child with this environment and working directory imports, module by module."""
    work = scratch / "probe"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=work, env=child_env(work), capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"cannot import mergeflow in the child environment:\n{done.stderr}")
    origin: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    origin["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
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


def run_case(case: Case, inputs: Path, out_dir: Path, scratch: Path) -> Path:
    """Run one case's merge command; raise SystemExit with its output if it fails."""
    target = out_dir / case.name
    work = scratch / case.name
    work.mkdir()
    # A neutral working directory: `python -m` puts it first on sys.path, and the repository root
    # would shadow the mergeflow that PYTHONPATH selects.
    command = [sys.executable, "-m", "mergeflow", "merge", *case.resolved(inputs), "--target_dir", str(target)]
    print(f"[{case.name}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=work, env=child_env(work), capture_output=True, text=True,
                          timeout=MERGE_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(
            f"[{case.name}] merge exited {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}\n"
            f"--- stderr ---\n{done.stderr[-8000:]}"
        )
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"[{case.name}] the last stdout line is not the result JSON:\n{done.stdout[-4000:]}") from None
    if Path(result["output_dir"]).resolve() != target.resolve() or not target.is_dir():
        raise SystemExit(f"[{case.name}] expected output in {target}, the command said {result}")
    left = sorted(p.name for p in out_dir.iterdir() if case.name in p.name and p.name != case.name)
    if left:
        raise SystemExit(f"[{case.name}] the export left entries beside its target: {left}")
    return target


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


def tree_digests(root: Path) -> dict[str, str]:
    """Relative POSIX path -> sha256 of every file under `root` (links are refused, not followed)."""
    out: dict[str, str] = {}
    for path in _files(root):
        if path.is_symlink() or not path.is_file():
            raise SystemExit(f"{path}: not a plain file")
        out[path.relative_to(root).as_posix()] = sha256_file(path)
    return out


def cmd_export(inputs: Path, out_dir: Path, digests_path: Path, expect_under: Path | None, only: list[str]) -> int:
    inputs = inputs.resolve()
    cases = load_cases(inputs)
    if only:
        unknown = sorted(set(only) - {c.name for c in cases})
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}")
        cases = [c for c in cases if c.name in only]
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"{out_dir} exists and is not empty: every target must be new")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    scratch = Path(tempfile.mkdtemp(prefix="mergeflow-digests-"))
    try:
        origin = probe_origin(scratch)
        print(f"mergeflow under test: {_summary(origin)}", file=sys.stderr, flush=True)
        if expect_under is not None:
            check_origin(origin, expect_under)
        digests: Digests = {}
        for case in cases:
            digests[case.name] = tree_digests(run_case(case, inputs, out_dir, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    digests_path.write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
    origin_path = digests_path.with_name(f"{digests_path.stem}.origin.json")
    origin_path.write_text(json.dumps({"origin": origin, "inputs": str(inputs), "out_dir": str(out_dir)}, indent=2)
                           + "\n")
    print(json.dumps({"digests": str(digests_path), "cases": len(digests),
                      "files": sum(len(v) for v in digests.values())}))
    return 0


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


def compare_digests(a: Digests, b: Digests, outputs: tuple[Path, Path] | None = None) -> list[str]:
    """Every difference between two digest maps, one line each (with key-level JSON diffs if outputs)."""
    lines: list[str] = []
    for case in sorted(set(a) | set(b)):
        if case not in b:
            lines.append(f"{case}: case only in A")
            continue
        if case not in a:
            lines.append(f"{case}: case only in B")
            continue
        fa, fb = a[case], b[case]
        for rel in sorted(set(fa) | set(fb)):
            if rel not in fb:
                lines.append(f"{case}/{rel}: only in A")
            elif rel not in fa:
                lines.append(f"{case}/{rel}: only in B")
            elif fa[rel] != fb[rel]:
                lines.append(f"{case}/{rel}: sha256 differs (A {fa[rel][:12]}, B {fb[rel][:12]})")
                if outputs is not None and rel.endswith(".json"):
                    try:
                        ja = json.loads((outputs[0] / case / rel).read_text())
                        jb = json.loads((outputs[1] / case / rel).read_text())
                    except (OSError, json.JSONDecodeError) as err:
                        lines.append(f"    (cannot diff the JSON: {err})")
                    else:
                        lines.extend(f"    {d}" for d in _json_diffs(ja, jb))
    return lines


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
    compare = sub.add_parser("compare", help="compare two digest files; exit 1 on any difference")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.add_argument("--outputs", nargs=2, type=Path, metavar=("A_OUT", "B_OUT"),
                         help="the two export OUT_DIRs, to diff differing JSON files key by key")
    args = parser.parse_args(argv)
    if args.command == "build":
        return cmd_build(args.inputs)
    if args.command == "export":
        return cmd_export(args.inputs, args.out_dir, args.digests, args.expect_mergeflow_under, args.only)
    return cmd_compare(args.a, args.b, args.outputs)


if __name__ == "__main__":
    sys.exit(main())
