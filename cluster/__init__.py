"""The service: engine core, public front ends, the Ray path, benchmarks and the CLI, one sub-package each."""
