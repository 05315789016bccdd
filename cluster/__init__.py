"""Control plane: config, requests, scheduler, engine, server, client, CLI, metrics, benchmarks."""
