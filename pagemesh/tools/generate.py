"""`pagemesh generate`: a streaming client of the router's public API."""

from __future__ import annotations

import argparse
import sys

import grpc

from pagemesh.runtime.config import tls_config
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(text=args.prompt, apply_chat_template=args.chat)
    request.sampling.temperature = args.temperature
    request.sampling.top_k = args.top_k
    if args.top_p is not None:
        request.sampling.top_p = args.top_p
    if args.seed is not None:
        request.sampling.seed = args.seed
    if args.max_tokens is not None:
        request.stopping.max_tokens = args.max_tokens
    request.stopping.stop.extend(args.stop or [])
    return request


def run_generate(args: argparse.Namespace) -> int:
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with tls_config(args).channel(args.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            last = None
            for chunk in stub.Generate(build_request(args), metadata=metadata):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    sys.stdout.write("\n")
    if args.usage and last is not None:
        reason = generate_pb2.FinishReason.Name(last.finish_reason)
        print(
            f"[{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} completion "
            f"tokens, {reason}]",
            file=sys.stderr,
        )
    return 0
