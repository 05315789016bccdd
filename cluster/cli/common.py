"""Flags shared by sub-commands and their mapping onto MTPServeConfig."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import ValidationError

from mtpserve.workers.config import MTPServeConfig


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Model, speculation and scheduling flags used by serve, generate --local and bench."""
    g = p.add_argument_group("engine")
    g.add_argument("--config", help="YAML config file; flags below override it")
    g.add_argument("--model", help="HF Llama, Qwen or DeepSeek-V3 directory, or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy = random weights (DeepSeek-V3: made in place on the device, so real shapes need no host copy)",
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the model runs (default auto)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, help="cap on prompt + output tokens")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (CUDA only; for debugging)")
    g.add_argument(
        "--no-overlap",
        action="store_true",
        help="read each decode step's tokens before queueing the next (CUDA graphs; for debugging)",
    )
    g.add_argument(
        "--no-overlap-speculative",
        action="store_true",
        help="overlap target-only steps only: read each speculative step before queueing the next",
    )
    g.add_argument(
        "--no-fused-kernels",
        action="store_true",
        help="plain torch ops instead of the fused Triton layer kernels (CUDA only; for debugging)",
    )
    g.add_argument(
        "--no-prefill-graphs",
        action="store_true",
        help="run every prefill step eagerly, also a lone request's prompt chunk (CUDA graphs; for debugging)",
    )
    g.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch the small-step kernels without programmatic dependent launch (Hopper and newer; for debugging)",
    )
    g.add_argument(
        "--gemv-tiles",
        help="tiles of the small-step matrix-vector kernels: auto (default: the table measured on this GPU model, "
        "else the built-in tiles), default, or a table such as 1=8x0,2=8x0r,4=4x2g2,16=8x0g4 (output columns x "
        "warps per program by row count, r: rows reduced one at a time, gN: N rows per program, which lets steps "
        "of 8-32 rows such as a tree's verify take the kernels; modeling/gemv_tiles.py)",
    )
    g.add_argument(
        "--draft",
        help="draft head: 'default' (shipped head, or the checkpoint's MTP modules), 'native' (the checkpoint's "
        "MTP modules), 'random' (untrained, explicit), a .safetensors path, or an EAGLE-3 checkpoint directory "
        "(with --spec-method eagle3)",
    )
    g.add_argument(
        "--spec-method",
        choices=["mtp_eagle", "eagle3", "mtp_vanilla"],
        help="mtp_eagle: one MTP module reused K times (default); eagle3: an EAGLE-3 head (SpecForge / SGLang / "
        "vLLM speculators directory) reused K times; mtp_vanilla: one native module per draft position",
    )
    g.add_argument("--num-draft-tokens", type=int, help="K, draft tokens per step (1-8); with a tree, its depth")
    g.add_argument(
        "--spec-tree-budget",
        type=int,
        help="draft a tree of N nodes per request and step (EAGLE-2 style, depth K), verified in one target pass; "
        "0 (default): a linear chain of K drafts. Trees accept more per step, but on SmolLM2 a tree step costs "
        "more than it gains (bench/README.md)",
    )
    g.add_argument("--spec-tree-width", type=int, help="children per expanded tree node, and nodes per level (1-16)")
    g.add_argument(
        "--spec-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose each step's draft depth (0..--num-draft-tokens) from the batch size, the measured step "
        "cost and the running acceptance; depth 0 keeps the draft's KV current without drafting; with "
        "--spec-tree-budget N (N > K), the tree is a candidate too, chosen where it gives the most tokens per second",
    )
    g.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    g.add_argument(
        "--lookahead-source",
        choices=["prompt", "sampled"],
        help="'sampled' reproduces the pre-fix bug (ablation)",
    )
    g.add_argument("--chunk-size", type=int, help="max prompt tokens per request per step")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="token budget per step (default: max-num-requests x (draft tokens + 1) + max(chunk size, 8192), so a "
        "full decode batch always fits and prompts take what is left)",
    )
    g.add_argument("--max-num-requests", type=int, help="concurrent running requests")
    g.add_argument("--num-kv-blocks", type=int, help="KV cache blocks (default: sized from max-num-requests)")
    g.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV (target and draft) of prompt prefixes earlier requests computed (default: on)",
    )
    g.add_argument("--tp", type=int, help="tensor-parallel size (runs through Ray actors when > 1)")
    g.add_argument("--draft-placement", choices=["separate", "colocated"], help="draft worker on its own device or not")
    g.add_argument("--distributed", action="store_true", default=None, help="use Ray actors even at --tp 1")
    g.add_argument("--address", help="existing Ray cluster address (default: start a local one)")


def config_from_args(args: argparse.Namespace) -> MTPServeConfig:
    """Merge --config YAML with flag overrides; exits with a field-named message on bad values."""
    a = vars(args)
    overrides: dict[str, Any] = {
        "model.path": a.get("model"),
        "model.load_format": a.get("load_format"),
        "model.device": a.get("device"),
        "model.dtype": a.get("dtype"),
        "model.max_model_len": a.get("max_model_len"),
        "model.cuda_graphs": False if a.get("enforce_eager") else None,
        "model.fused_kernels": False if a.get("no_fused_kernels") else None,
        "model.pdl": False if a.get("no_pdl") else None,
        "model.gemv_tiles": a.get("gemv_tiles"),
        "model.prefill_graphs": False if a.get("no_prefill_graphs") else None,
        "model.overlap_steps": False if a.get("no_overlap") else None,
        "model.overlap_speculative": False if a.get("no_overlap_speculative") else None,
        "speculative.draft": a.get("draft"),
        "speculative.method": a.get("spec_method"),
        "speculative.num_draft_tokens": a.get("num_draft_tokens"),
        "speculative.tree_budget": a.get("spec_tree_budget"),
        "speculative.tree_width": a.get("spec_tree_width"),
        "speculative.adaptive": a.get("spec_adaptive"),
        "speculative.enabled": False if a.get("no_speculation") else None,
        "speculative.lookahead_source": a.get("lookahead_source"),
        "scheduler.chunk_size": a.get("chunk_size"),
        "scheduler.max_num_batched_tokens": a.get("max_num_batched_tokens"),
        "scheduler.max_num_requests": a.get("max_num_requests"),
        "scheduler.num_kv_blocks": a.get("num_kv_blocks"),
        "scheduler.prefix_caching": a.get("prefix_caching"),
        "parallel.tp_size": a.get("tp"),
        "parallel.draft_placement": a.get("draft_placement"),
        "parallel.distributed": a.get("distributed"),
        "parallel.ray_address": a.get("address"),
        "server.host": a.get("host"),
        "server.port": a.get("port"),
        "server.metrics_port": a.get("metrics_port"),
        "server.metrics_host": a.get("metrics_host"),
        "server.http_port": a.get("http_port"),
        "server.tls.cert_file": a.get("tls_cert"),
        "server.tls.key_file": a.get("tls_key"),
        "server.tls.client_ca_file": a.get("tls_client_ca"),
        "server.auth_token_file": a.get("auth_token_file"),
        "server.allow_insecure": True if a.get("allow_insecure") else None,
        "server.engine_process": a.get("engine_process"),
        "server.frontends": a.get("frontends"),
    }
    try:
        if a.get("config"):
            return MTPServeConfig.from_yaml(a["config"], overrides)
        return MTPServeConfig.from_dict({}, overrides)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "config"
            print(f"mtpserve: invalid config: {loc}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
    except (OSError, ValueError) as exc:
        print(f"mtpserve: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
