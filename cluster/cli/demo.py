"""`python -m mtpserve.cluster.cli.demo`: start `mtpserve serve` on the default model, send one request, stop."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from mtpserve.cluster.service.client import MTPServeClient

PROMPT = "Give me three tips for writing clear Python code."


def main(argv: list[str] | None = None) -> int:
    """Serve, query through the gRPC client, print the reply and its acceptance stats, shut down."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("serve_args", nargs="*", help="extra flags for `mtpserve serve` (after --)")
    args = parser.parse_args(argv)
    cmd = [sys.executable, "-m", "mtpserve", "serve", "--port", "0", "--metrics-port", "0", *args.serve_args]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env={**os.environ})
    try:
        address = _wait_for_address(proc, timeout=600)
        with MTPServeClient(address, timeout=600) as client:
            info = client.model_info()
            print(f"model: {json.dumps(info)}", flush=True)
            print(f"\n>>> {args.prompt}\n", flush=True)
            result: dict = {}
            for chunk in client.stream(args.prompt, max_tokens=args.max_tokens):
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason:
                    result = {"finish_reason": chunk.finish_reason, "stats": chunk.stats}
            print("\n\n" + json.dumps(result, indent=2))
            print(json.dumps(client.stats(), indent=2))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_for_address(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"mtpserve serve exited early with code {proc.wait()}")
        print(line, end="", flush=True)
        m = re.search(r"serving gRPC on (\S+):(\d+)", line)
        if m:
            host = "127.0.0.1" if m.group(1) in ("0.0.0.0", "[::]", "::") else m.group(1)
            return f"{host}:{m.group(2)}"
    raise SystemExit("mtpserve serve did not report its address in time")


if __name__ == "__main__":
    sys.exit(main())
