"""How long a captured step holds the host in `replay()` (the CUDA-graph launch) against how long the GPU
runs it, for the target-only, fused chain and tree steps at a shape, with PDL on and off, and how many nodes
of each kind (kernel, memcpy, memset, ...) its batch-1 greedy graph holds. A step whose launch takes longer
than it should leaves the GPU idle when nothing is launched ahead of it.

python3 bench/probes/graph_launch.py --shape DIR --out $OUT      # DIR holds a config.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.layer_ops import TorchOps, TritonOps
from mtpserve.speculative.sampling import SamplingMode
from mtpserve.workers import tree_step
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.graph_runner import CapturedSteps

STEPS = {  # name: (K, tree budget, tree width)
    "target": (0, 0, 4),
    "chain3": (3, 0, 4),
    "tree4x16": (4, 16, 4),
    "tree4x16-torch": (4, 16, 4),  # the tree step with torch's top-k, walk and queued inputs (no tree kernels)
}


@contextlib.contextmanager
def torch_tree_ops(on: bool) -> Iterator[None]:
    """While `on`, tree steps built and run take torch's top-k, greedy walk and queued-input paths."""
    if not on:
        yield
        return
    saved = TritonOps.top_logprobs, tree_step.tree_kernels_apply
    TritonOps.top_logprobs = TorchOps.top_logprobs  # type: ignore[method-assign]
    tree_step.tree_kernels_apply = lambda t: False
    try:
        yield
    finally:
        TritonOps.top_logprobs, tree_step.tree_kernels_apply = saved  # type: ignore[method-assign]


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="a directory with a config.json")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"of {', '.join(STEPS)}")
    ap.add_argument("--pdl", default="on,off", help="PDL settings to try")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="out")
    return ap


def step_of(eng: LLMEngine, name: str) -> Any:
    """The engine's captured step object for `name`."""
    attr = {"target": "uniform", "chain3": "fused"}.get(name, "tree_step")
    return getattr(eng.target, attr)


NODE_KINDS = ("KERNEL", "MEMCPY", "MEMSET", "HOST", "EMPTY", "EVENT_RECORD", "WAIT_EVENT", "MEM_ALLOC", "MEM_FREE")


def node_kinds(graph: torch.cuda.CUDAGraph, where: Path) -> dict[str, Any]:
    """Occurrences of each node kind's name in the DOT dump of a graph captured with
    `CapturedSteps.keep_graphs` (node labels name their kind), and the dump's opening lines to read them by."""
    graph.debug_dump(str(where))
    if not where.is_file():  # the timing rows still count
        return {"error": "torch wrote no DOT dump for this graph"}
    text = where.read_text()
    counts: dict[str, Any] = {kind: len(re.findall(rf"\b{kind}\b", text)) for kind in NODE_KINDS}
    counts["dot_head"] = text[:1500]
    return counts


def measure(step: Any, bucket: int, repeats: int) -> dict[str, float]:
    """Median host ms inside replay, GPU ms of the graph, and wall ms of replay + wait, GPU idle before."""
    steps = step.steps.variants[SamplingMode.GREEDY]
    launch, gpu, wall = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        steps.run(bucket)
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append(1e3 * (t1 - t0))
        gpu.append(start.elapsed_time(end))
        wall.append(1e3 * (t2 - t0))
    graph = steps.graphs.get(bucket)
    return {
        "launch_ms": statistics.median(launch),
        "gpu_ms": statistics.median(gpu),
        "wall_ms": statistics.median(wall),
        "captured": graph is not None,
    }


def main() -> int:
    args = build_parser().parse_args()
    config = json.loads((Path(args.shape) / "config.json").read_text())
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(config))
    rows: list[dict[str, Any]] = []
    CapturedSteps.keep_graphs = True
    for pdl in args.pdl.split(","):
        for name in args.steps.split(","):
            k, budget, width = STEPS[name]
            cfg = MTPServeConfig.from_dict({
                "model": {"path": str(tmp), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
                          "max_model_len": 2048, "pdl": pdl == "on"},
                "scheduler": {"max_num_requests": 8},
                "speculative": {"enabled": k > 0, "draft": "random", "num_draft_tokens": max(k, 1),
                                "tree_budget": budget, "tree_width": width, "adaptive": False},
            })  # fmt: skip
            with torch_tree_ops(name.endswith("-torch")):
                eng = LLMEngine.from_config(cfg, load_tokenizer=False)
                eng.add_request(list(range(100, 164)), {"max_tokens": 10_000, "ignore_eos": True})
                for _ in range(8):
                    eng.step()
                torch.cuda.synchronize()
                step = step_of(eng, name)
                row = {"step": name, "pdl": pdl, **measure(step, 1, args.repeats)}
            graph = step.steps.variants[SamplingMode.GREEDY].graphs.get(1)
            if graph is not None:
                row["nodes"] = node_kinds(graph, tmp / f"{name}_{pdl}.dot")
            rows.append(row)
            print(json.dumps(row), flush=True)
            del eng
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"shape": config, "rows": rows}
    (out / f"graph_launch_{Path(args.shape).name}.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
