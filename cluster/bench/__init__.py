"""The benchmark measurements behind `mtpserve bench` and bench/gpu.py, and their shared report."""
