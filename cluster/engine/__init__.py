"""The engine core: requests, the scheduler, KV blocks, prefix keys and the step loop (no service, no Ray)."""
