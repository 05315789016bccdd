"""mtpserve API v1: generated protobuf and gRPC modules (regenerate with proto/gen.sh)."""
