"""Build an engine from config: in process, or through Ray actors for TP / separate draft workers."""

from __future__ import annotations

from cluster.config import MTPServeConfig
from cluster.engine import LLMEngine


def build_engine(cfg: MTPServeConfig) -> LLMEngine:
    """An LLMEngine whose target/draft executors match cfg.parallel."""
    if cfg.parallel.tp_size > 1 or cfg.parallel.distributed:
        from cluster.actors import build_distributed_engine

        return build_distributed_engine(cfg)
    return LLMEngine.from_config(cfg)
