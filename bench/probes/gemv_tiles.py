"""Tiles of the matrix-vector kernels, chosen in the served step: for each candidate (output columns and warps
per program, rows one at a time, rows per program), an adaptive engine at batch 1 times its captured steps at
every draft depth, and with --tree-budget its draft tree's step (candidates that split the rows into groups
only: a tree verifies more than 4 rows). The fastest candidate per padded row count (1 row: depth 0; 2: depth
1; 4: depths 2 and 3 together; the tree's rows: the tree step) makes one table, and the candidate fastest over
the chain depths, used for every row count, another. Each is timed again and decoded against the default
tiles (target-only, fixed K=1..k and the tree, tok/s), with a check that speculation's greedy tokens still
equal target-only's: tiles that sum a verify row in another order than a decode row round it differently.
`chosen_table` is the first table that keeps them (the uniform one is tried only when the per-row-count one
does not, then the fastest one-row-group candidate for every row count, which sums every row as a decode step
does): the line modeling/gemv_tiles.py's TUNED may record for this GPU.

Usage (on the GPU machine, from the repo root):
    python3 bench/probes/gemv_tiles.py --model /root/model/SmolLM2-135M-Instruct.Q4_1.gguf --tree-budget 15 --out $OUT
Prints the timings and the chosen table, and writes gemv_tiles.json under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.bench.decode import add_probe_flags, bench_prompts, decode_run, engine_for
from mtpserve.modeling.gemv_tiles import GROUPED_ONLY, GemvTiles, padded_rows, table_text
from mtpserve.workers.fused_step import FusedDepthSteps, FusedSpecStep
from mtpserve.workers.step_builders import graph_max_blocks

DEPTHS_OF_ROWS: dict[int, tuple[int | str, ...]] = {1: (0,), 2: (1,), 4: (2, 3)}  # padded verify rows -> the
# batch-1 steps they run (chain depths); the tree's padded rows run the step keyed TREE
TREE = "tree"


def parse_candidates(text: str) -> list[GemvTiles]:
    """`8x0,4x2r` -> the candidates; argparse's error names the flag and the bad item."""
    try:
        return [GemvTiles.parse(t) for t in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--candidates: {err}") from None


def steps_of_rows(tree_budget: int) -> dict[int, tuple[int | str, ...]]:
    """Padded verify rows -> the batch-1 steps they run: the chain depths, and the tree step (its budget plus
    the root, padded) with a tree."""
    if not tree_budget:
        return DEPTHS_OF_ROWS
    return {**DEPTHS_OF_ROWS, padded_rows(tree_budget + 1): (TREE,)}


def candidate_table(tiles: GemvTiles, rows: list[int]) -> str:
    """The table giving `tiles` to every row count of `rows` they can take (past 4 rows, tiles with groups)."""
    return table_text({r: tiles for r in rows if tiles.group or r < GROUPED_ONLY})


def choose_tiles(
    times: dict[str, dict[int | str, float]], candidates: dict[str, GemvTiles], tree_budget: int = 0
) -> dict[int, str]:
    """The fastest candidate for each padded row count, from each candidate's ms per step by depth (and tree);
    a row count whose steps were not timed is left out."""
    chosen = {}
    for rows, keys in steps_of_rows(tree_budget).items():
        able = [name for name in candidates if candidates[name].group or rows < GROUPED_ONLY]
        timed = [name for name in able if all(d in times[name] for d in keys)]
        if timed:
            chosen[rows] = min(timed, key=lambda name: sum(times[name][d] for d in keys))
    return chosen


def step_times(args: argparse.Namespace, table: str) -> dict[int | str, float]:
    """ms per batch-1 captured step by depth (0..k), and of the draft tree where one is captured, of an
    adaptive engine with `model.gemv_tiles` = table."""
    eng = engine_for(args, args.k, True, 1, variant="adaptive", gemv_tiles=table)
    runner: Any = eng.target
    steps = runner.steps.chain
    if steps is None:  # off CUDA nothing is captured: the same fixed-buffer steps, run eagerly
        blocks = graph_max_blocks(eng.cfg, args.k, eng.max_model_len)
        model, cache, chain, dev = runner.model, runner.cache, eng.draft, runner.device
        chain = getattr(chain, "chain", chain)  # a tree drafter's chain steps
        made = {
            d: FusedSpecStep(model, cache, chain, d, max_batch=1, max_blocks=blocks, device=dev, use_graphs=False)
            for d in range(args.k + 1)
        }
        steps = FusedDepthSteps(made)
    times: dict[int | str, float] = {d: 1e3 * s for (b, d), s in steps.time_steps(args.repeats).items() if b == 1}
    if runner.steps.tree is not None:
        times[TREE] = 1e3 * runner.steps.tree.time_steps(args.repeats)[1]
    del eng, runner, steps
    release()
    return times


def tok_s(args: argparse.Namespace, table: str) -> dict[str, Any]:
    """Batch-1 decode rates with `model.gemv_tiles` = table: target-only, fixed K=1..k and the tree (with
    --tree-budget), with speedups, and whether each one's greedy tokens equal target-only's (tiles that round
    verify rows unlike decode rows break that)."""
    out: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    runs = [(k, False) for k in range(args.k + 1)] + ([(args.k, True)] if args.tree_budget else [])
    for k, tree in runs:
        eng = engine_for(args, k, True, 1, gemv_tiles=table, tree=tree)
        prompt = bench_prompts(eng, 1)
        decode_run(eng, prompt, 8)
        r = decode_run(eng, prompt, args.max_tokens)
        name = f"tree{args.tree_budget}" if tree else f"K={k}" if k else "target-only"
        out[name] = {"tok_s": r["tok_s"], "step_ms": r["step_ms"], "acceptance_length": r["acceptance_length"]}
        tokens[name] = r["outputs"][0]
        del eng
        release()
    for name, row in out.items():
        row["speedup"] = row["tok_s"] / out["target-only"]["tok_s"]
        row["greedy_equal"] = tokens[name] == tokens["target-only"]
    return out


def release() -> None:
    """Free the last engine's memory before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probe_flags(ap)
    ap.add_argument("--k", type=int, default=3, help="the deepest draft depth (and the tree's depth)")
    ap.add_argument(
        "--tree-budget", type=int, default=0, help="also time and decode a draft tree of this many nodes (0: none)"
    )
    ap.add_argument("--tree-width", type=int, default=4, help="the tree's children per expanded node")
    ap.add_argument(
        "--candidates",
        type=parse_candidates,
        default=parse_candidates("8x0,8x0r,4x2r,8x0g1,8x0g2,8x0rg2,8x0g4"),
        help="COLUMNSxWARPS[r][gN],... (output columns and warps per program, warps 0: 4, or 8 past 1,024 inputs; "
        "r: rows reduced one at a time; gN: N rows per program, which alone take the tree's rows; "
        "modeling/gemv_tiles.py)",
    )
    ap.add_argument("--repeats", type=int, default=50, help="replays per timed step")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens decoded in each rate run")
    ap.add_argument("--out", default="out")
    return ap


def main() -> int:
    """Time every candidate, choose, and compare the chosen table with the default tiles."""
    args = build_parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    candidates = {t.text(): t for t in args.candidates}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"command": " ".join(sys.argv), "gpu": gpu, "step_ms": {}, "tok_s": {}}

    def save() -> None:  # after every stage, so a run cut short keeps what finished
        (out / "gemv_tiles.json").write_text(json.dumps(report, indent=2))

    rows_all = list(steps_of_rows(args.tree_budget))

    def line(times: dict[int | str, float]) -> str:
        return " ".join(f"{d if d == TREE else f'd{d}'} {ms:.3f}" for d, ms in times.items())

    for name, tiles in candidates.items():
        report["step_ms"][name] = step_times(args, candidate_table(tiles, rows_all))
        print(name, line(report["step_ms"][name]), flush=True)
        save()
    per_rows = choose_tiles(report["step_ms"], candidates, args.tree_budget)
    chain_ms = {name: sum(ms for d, ms in report["step_ms"][name].items() if d != TREE) for name in candidates}
    uniform = candidates[min(candidates, key=chain_ms.__getitem__)]
    tables = report["tables"] = {
        "per_rows": table_text({rows: candidates[name] for rows, name in per_rows.items()}),
        # one reduction order for every row count
        "uniform": candidate_table(uniform, [r for r in rows_all if r in per_rows]),
    }
    singles = [name for name in candidates if candidates[name].group == 1]
    if singles:  # one row per program everywhere: verify rows sum as decode rows, trees included
        fastest = min(singles, key=lambda n: sum(report["step_ms"][n].values()))
        tables["rows1"] = candidate_table(candidates[fastest], rows_all)
    report["per_rows_step_ms"] = step_times(args, tables["per_rows"])
    print("per rows", tables["per_rows"], line(report["per_rows_step_ms"]))
    save()
    report["chosen_table"] = ""  # the first table that keeps the greedy tokens: what TUNED may record
    for label in ("per_rows", "uniform", "rows1", "default"):
        setting = tables.get(label, "default")
        tried = [tables[t] for t in report["tok_s"] if t in tables]
        if label in ("uniform", "rows1") and (label not in tables or report["chosen_table"] or setting in tried):
            continue
        rows = report["tok_s"][label] = tok_s(args, setting)
        keeps = all(r["greedy_equal"] for r in rows.values())
        if keeps and label != "default" and not report["chosen_table"]:
            report["chosen_table"] = setting
        rates = "  ".join(f"{k} {r['tok_s']:.0f} tok/s ({r['speedup']:.2f}x)" for k, r in rows.items())
        print(label, setting, f"greedy tokens kept: {keeps};", rates, flush=True)
        save()
    print("chosen table:", report["chosen_table"] or "none keeps the greedy tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
