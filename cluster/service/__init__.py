"""The public service over the engine: the engine thread, gRPC and HTTP front ends, auth, metrics, client."""
