"""The web layer (aiohttp): routes, the optional API key, OpenAI's error JSON and
Server-Sent Events. Everything else is `service.Frontend`'s.

    GET  /health                 200 once the front door serves (no key needed)
    GET  /v1/models              the served models
    GET  /v1/models/{model}
    POST /v1/completions
    POST /v1/chat/completions    stream: true answers `data: {chunk}` events, then `data: [DONE]`
    POST /tokenize, /detokenize  vLLM's: a prompt (or chat messages) to token ids and back
    POST /generate               SGLang's native endpoint (`sglang.py`), on the first model

The server runs with aiohttp's handler cancellation: a client that disconnects
cancels its handler task, and the generation's gRPC stream is closed on the way out,
which cancels the Triton request.
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import AsyncIterator, Optional

from aiohttp import web

from . import sglang
from .protocol import CHAT, COMPLETIONS, OpenAIError, parse_request
from .service import Frontend

log = logging.getLogger("openai_frontend")
MAX_BODY_BYTES = 16 << 20
FRONTEND_KEY = web.AppKey("frontend", Frontend)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def error_response(error: OpenAIError) -> web.Response:
    return web.json_response(error.body(), status=error.status, dumps=_dumps)


def _event(obj) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode("utf-8")


def api_key_middleware(api_key: str):
    expected = api_key.encode("utf-8")

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if not header:
                return error_response(OpenAIError(401, "Missing API key: send the header "
                                                       "'Authorization: Bearer <key>'", code="invalid_api_key"))
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8"), expected):
                return error_response(OpenAIError(401, "Incorrect API key provided", code="invalid_api_key"))
        return await handler(request)

    return check


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except OpenAIError as e:
        return error_response(e)
    except web.HTTPException as e:  # unknown route, wrong method, body too large
        if e.status < 400:
            raise
        return error_response(OpenAIError(e.status, f"{request.method} {request.path}: {e.reason}"))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(OpenAIError(500, "internal error in the front door (see its log)"))


async def _json_body(request: web.Request):
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None


async def models(request: web.Request) -> web.Response:
    return web.json_response(request.app[FRONTEND_KEY].models(), dumps=_dumps)


async def model(request: web.Request) -> web.Response:
    return web.json_response(request.app[FRONTEND_KEY].model(request.match_info["model"]), dumps=_dumps)


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def tokenize(request: web.Request) -> web.Response:
    return web.json_response(request.app[FRONTEND_KEY].tokenize(await _json_body(request)), dumps=_dumps)


async def detokenize(request: web.Request) -> web.Response:
    return web.json_response(request.app[FRONTEND_KEY].detokenize(await _json_body(request)), dumps=_dumps)


def generation_handler(endpoint: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        frontend = request.app[FRONTEND_KEY]
        gen = parse_request(await _json_body(request), endpoint, frontend.sampling_defaults)
        if not gen.stream:
            return web.json_response(await frontend.complete(gen), dumps=_dumps)
        return await _stream(request, frontend.chunks(gen))

    return handle


async def sglang_generate(request: web.Request) -> web.StreamResponse:
    frontend = request.app[FRONTEND_KEY]
    gen, batched, rids = sglang.parse_generate(await _json_body(request), frontend.names[0],
                                               min(sglang.MAX_NEW_TOKENS, frontend.default_max_tokens),
                                               frontend.sampling_defaults)
    if not gen.stream:
        return web.json_response(await sglang.answer(frontend, gen, batched, rids), dumps=_dumps)
    return await _stream(request, sglang.events(frontend, gen, rids))


async def _stream(request: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    """Server-Sent Events. An error before the first chunk is an ordinary HTTP error; one
    after it is sent as a `data: {"error": ...}` event before `[DONE]`."""
    response: Optional[web.StreamResponse] = None
    try:
        first = await chunks.__anext__()
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        await response.write(_event(first))
        async for chunk in chunks:
            await response.write(_event(chunk))
    except OpenAIError as e:
        if response is None:
            raise
        log.warning("stream %s failed: %s", request.path, e.message)
        await response.write(_event(e.body()))
    finally:
        await chunks.aclose()  # closes the gRPC stream: cancels the request if it still runs
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def create_app(frontend: Frontend, api_key: Optional[str] = None) -> web.Application:
    middlewares = [error_middleware] + ([api_key_middleware(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[FRONTEND_KEY] = frontend
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/completions", generation_handler(COMPLETIONS))
    app.router.add_post("/v1/chat/completions", generation_handler(CHAT))
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/generate", sglang_generate)
    return app
