"""The model layer: Llama-family target, paged attention and KV cache, Triton kernels, TP context, loaders."""
