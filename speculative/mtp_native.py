"""A checkpoint's own MTP modules (DeepSeek-V3 `num_nextn_predict_layers`) as draft heads.

Module j sits in the checkpoint as decoder layer `num_hidden_layers + j`, with enorm, hnorm, eh_proj and
shared_head.norm beside its attention and experts; its embedding and shared_head.head are the target's.
The first module reads the target's final-normed hidden state, as the modules were trained.
"""

from __future__ import annotations

import torch

from mtpserve.modeling.deepseek_config import DeepseekV3Args
from mtpserve.modeling.deepseek_weights import load_layer, put, taker
from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.families import InPlaceDummy
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.mtp_head import MTPEagleHead


def num_native_modules(args: LlamaArgs) -> int:
    """MTP modules a checkpoint of this config carries (0 for families without them)."""
    return args.num_nextn_predict_layers if isinstance(args, DeepseekV3Args) else 0


@torch.no_grad()
def native_heads(args: LlamaArgs, weights: dict[str, torch.Tensor], count: int | None = None) -> list[MTPEagleHead]:
    """The first `count` (default all) MTP modules of the checkpoint, as heads; ModelLoadError when absent.
    For an in-place dummy load the heads are built on the meta device."""
    available = num_native_modules(args)
    count = available if count is None else count
    if count < 1 or count > available:
        raise ModelLoadError(f"the checkpoint has {available} MTP module(s); {count} were asked for")
    assert isinstance(args, DeepseekV3Args)
    if isinstance(weights, InPlaceDummy):  # the modules get storage and random weights on their device later
        return [_meta_head(args) for _ in range(count)]
    heads = []
    for j in range(count):
        p = f"model.layers.{args.num_hidden_layers + j}."
        take = taker(weights, args.weight_block)
        head = MTPEagleHead(args, own_norm=True)
        head.normed_input = True
        try:
            put(head.enorm.weight, take(p + "enorm.weight"), p + "enorm.weight")
            put(head.hnorm.weight, take(p + "hnorm.weight"), p + "hnorm.weight")
            put(head.eh_proj.weight, take(p + "eh_proj.weight"), p + "eh_proj.weight")
            assert head.final_norm is not None
            put(head.final_norm.weight, take(p + "shared_head.norm.weight"), p + "shared_head.norm.weight")
            load_layer(head.layer, weights, p, args)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"MTP module {j} (layer {args.num_hidden_layers + j}): {exc}") from exc
        heads.append(head)
    return heads


def _meta_head(args: DeepseekV3Args) -> MTPEagleHead:
    with torch.device("meta"):
        head = MTPEagleHead(args, own_norm=True)
    head.normed_input = True
    return head
