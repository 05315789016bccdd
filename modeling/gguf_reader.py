"""Read a llama-architecture GGUF file into an HF-style config dict and HF-named fp32 tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any) -> dict[str, Any]:
    """Translate GGUF llama metadata into an HF LlamaConfig-style dict."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture '{arch}' is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    heads = int(_field(reader, "llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k projection weights."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (hf_config, tensors) with every tensor dequantised to fp32 and named as in HF Llama."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    out: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        stem, _, kind = t.name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk":
            layer, short = parts[1], parts[2]
            hf = f"model.layers.{layer}.{_LAYER_NAMES[short]}.{kind}"
        elif stem in _TOP_NAMES:
            short = stem
            hf = f"{_TOP_NAMES[stem]}.{kind}"
        else:
            raise ValueError(f"unexpected GGUF tensor '{t.name}'")
        shape = tuple(int(x) for x in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if short == "attn_q":
            arr = _unpermute(arr, cfg["num_attention_heads"])
        elif short == "attn_k":
            arr = _unpermute(arr, cfg["num_key_value_heads"])
        out[hf] = torch.from_numpy(arr.copy())
        if progress:
            progress(i + 1, total)
    return cfg, out
