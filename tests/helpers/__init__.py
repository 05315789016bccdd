"""What several test modules share: tiny models, SmolLM2, servers in subprocesses, streams and soaks."""
