"""Worker runtimes: target runner, captured steps, Ray target/draft actors, TP set-up, worker gRPC."""
