"""Build an engine from config: in process, or through Ray actors for TP / separate draft workers."""

from __future__ import annotations

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig


def build_engine(cfg: MTPServeConfig) -> LLMEngine:
    """An LLMEngine whose target/draft executors match cfg.parallel: Ray actors when tp_size > 1,
    `distributed` is set or a Ray address is given; otherwise everything runs in this process."""
    if cfg.parallel.uses_ray:
        from mtpserve.cluster.distributed.actors import build_distributed_engine

        return build_distributed_engine(cfg)
    return LLMEngine.from_config(cfg)
