"""The public gRPC `Generation` service: a thin adapter over the router's data plane.

Each method converts its request (router/convert.py), calls `router.generation.Generation`,
and converts the result back; the OpenAI HTTP API (router/http_api.py) adapts the same
object, so both APIs behave alike. `ServiceError`s become status codes in
pagemesh/runtime/serving.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import grpc

from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from router import convert
from router.generation import Generation


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetModelInfoResponse:
        return convert.model_info_response(await self.generation.model_info())

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        owner = self.generation.tenancy.owner(_authorization(context))
        token_ids, tokens = await self.generation.tokenize(
            request.text, request.apply_chat_template, owner
        )
        return convert.tokenize_response(token_ids, tokens)

    async def Embed(
        self, request: generate_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.EmbedResponse:
        owner = self.generation.tenancy.owner(_authorization(context))
        result = await self.generation.embed(convert.embedding_request(request, owner))
        return convert.embed_response(result)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        # Closing this stream (the client went away) closes the data plane's: that cancels
        # the request down the mesh.
        owner = self.generation.tenancy.owner(_authorization(context))
        generation_request = dataclasses.replace(convert.generation_request(request), owner=owner)
        batches = self.generation.generate(generation_request)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for chunk in batch:
                    yield convert.generate_response(chunk)


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's `authorization` metadata (checked by pagemesh.runtime.auth's interceptor)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None
