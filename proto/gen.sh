#!/usr/bin/env bash
# Regenerate the Python code for proto/mtpserve/v1/*.proto (messages, gRPC stubs, type stubs).
#
#   proto/gen.sh            write next to the .proto files (the committed copies)
#   proto/gen.sh OUT_DIR    write under OUT_DIR/mtpserve/v1 instead (the freshness test compares the two)
#
# PYTHON picks the interpreter (default: the repo's .venv, else python3); it needs grpcio-tools.
# protoc emits `from mtpserve.v1 import x_pb2`; we rewrite that to `from mtpserve.proto.mtpserve.v1 import x_pb2`
# so the generated modules import as a package from the repository root. The stubs' GRPC_GENERATED_VERSION (the
# oldest grpcio they import under) is stamped with pyproject.toml's grpcio floor, not the generator's own
# version, so that a newer grpcio-tools writes the same files.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
out="${1:-proto}"
floor="$(sed -n -E 's/^ *"grpcio>=([0-9.]+)".*/\1/p' pyproject.toml)"
[[ -n "$floor" ]] || { echo "gen.sh: no grpcio>= floor in pyproject.toml" >&2; exit 1; }
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I proto \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  proto/mtpserve/v1/*.proto
for f in "$out"/mtpserve/v1/*_pb2*.py "$out"/mtpserve/v1/*_pb2.pyi; do
  [[ -e "$f" ]] || continue
  sed -i -E 's/^from mtpserve\.v1 import /from mtpserve.proto.mtpserve.v1 import /; s/^import mtpserve\.v1\./import mtpserve.proto.mtpserve.v1./' "$f"
  sed -i -E "s/^GRPC_GENERATED_VERSION = '[0-9.]+'$/GRPC_GENERATED_VERSION = '$floor'/" "$f"
done
