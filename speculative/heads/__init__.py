"""Shipped draft heads (safetensors) and their model cards."""
