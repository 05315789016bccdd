"""Server CPU per streamed gRPC message: the sync server (a thread per stream) against grpc.aio (coroutines on
one event loop), with `mtpserve.v1.Inference.Generate` messages of one token each and nothing else running.
It is the ceiling a streaming front end puts on tokens per second before any engine work. The server runs in a
child process; its CPU time per message comes from `time.process_time` read between rounds.

python3 bench/probes/grpc_stream_cost.py --streams 64 --messages 128 --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.cluster.bench.stream_clients import Job, run_job
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb
from mtpserve.proto.mtpserve.v1 import inference_pb2_grpc as pb_grpc

KINDS = ("sync", "aio")


class SyncStreams(pb_grpc.InferenceServicer):
    """Generate as the sync server runs it: one handler thread per stream, yielding each message."""

    def __init__(self, messages: int) -> None:
        self.messages = messages

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        """`messages` one-token messages."""
        for i in range(self.messages):
            yield pb.GenerateResponse(request_id="r", token_ids=[i])


class AioStreams(pb_grpc.InferenceServicer):
    """Generate as a grpc.aio coroutine."""

    def __init__(self, messages: int) -> None:
        self.messages = messages

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """`messages` one-token messages."""
        for i in range(self.messages):
            yield pb.GenerateResponse(request_id="r", token_ids=[i])


def serve(kind: str, messages: int) -> None:
    """The child: serve, print the port, then answer each stdin line with this process's CPU seconds."""
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(256))
        pb_grpc.add_InferenceServicer_to_server(SyncStreams(messages), server)
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        server.start()
        for _ in sys.stdin:
            print(time.process_time(), flush=True)
        return

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(AioStreams(messages), server)
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        await server.start()
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(time.process_time(), flush=True)

    asyncio.run(main())


def measure(kind: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """`--repeats` rounds against one server of `kind`: messages per second and server CPU microseconds each."""
    cmd = [sys.executable, __file__, "--serve", kind, "--messages", str(args.messages)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    port = int(child.stdout.readline())

    def cpu() -> float:
        child.stdin.write("\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return float(child.stdout.readline())  # type: ignore[union-attr]

    rows = []
    try:
        for _ in range(args.repeats):
            c0 = cpu()
            job = Job(
                "grpc", {"grpc": f"127.0.0.1:{port}", "http": ""}, [[1]] * args.streams, 1, channels=args.channels
            )
            got = run_job(job)
            seconds, n = max(s.end for s in got) - min(s.sent for s in got), sum(s.chunks for s in got)
            row = {"messages": n, "msg_per_s": n / seconds, "server_cpu_us_per_msg": 1e6 * (cpu() - c0) / n}
            rows.append(row)
            print(f"{kind}: {row['msg_per_s']:8.0f} msg/s, {row['server_cpu_us_per_msg']:5.1f} us server CPU a message")
    finally:
        child.kill()
    return rows


def main() -> None:
    """Run every kind and print (and with --out save) the figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams per round")
    p.add_argument("--messages", type=int, default=128, help="messages per stream")
    p.add_argument("--channels", type=int, default=8, help="client channels the streams spread over")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="folder for grpc_stream_cost.json")
    p.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.messages)
        return
    doc = {"command": " ".join(sys.argv), "settings": vars(args), "results": {k: measure(k, args) for k in KINDS}}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grpc_stream_cost.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
