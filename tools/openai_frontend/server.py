"""Command line: start the OpenAI-compatible front door in front of a running Triton.

    python tools/openai_frontend --triton-url localhost:8001 --port 9000
    SPECDEC_API_KEY=secret python tools/openai_frontend --port 9000   # clients send the key

Waits for Triton to be READY, finds the models it can serve (`--triton-models`, in
that order: every one that is loaded and has text or token tensors), loads the
tokenizer the repository's preprocessing names and the model's sampling defaults
(`--generation-config`, `sampling_defaults.py`), then listens. `tools/launch_triton_server.py
--openai_port N` starts and stops it with the server.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

DEFAULT_MODELS = "tensorrt_llm_bls,speculative_decoding,ensemble"
API_KEY_ENV = "SPECDEC_API_KEY"
log = logging.getLogger("openai_frontend")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="openai_frontend",
                                description="The OpenAI-compatible front door for a running Triton server.")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC endpoint")
    p.add_argument("--triton-models", default=DEFAULT_MODELS,
                   help="Triton models to serve, in this order (absent ones are skipped); the first is "
                        "listed first by /v1/models")
    p.add_argument("--served-model-name", default=None,
                   help="another name for the first served model (e.g. the checkpoint's name)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the repository's preprocessing tokenizer_dir)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file instead of the tokenizer's")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for the fields a request leaves out: 'auto' (the served "
                        "checkpoint's generation_config.json, as vLLM and SGLang), 'openai' (OpenAI's: "
                        "temperature 1, top_p 1; vLLM's 'vllm' too), or a folder with a generation_config.json")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on /v1/* (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--triton-header", action="append", default=[], metavar="KEY=VALUE",
                   help="gRPC metadata sent to Triton on every call (e.g. for --grpc-restricted-protocol)")
    p.add_argument("--wait-s", type=float, default=900.0, help="how long to wait for Triton to be READY")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _headers(items: list[str]) -> Optional[dict[str, str]]:
    headers = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"openai_frontend: error: --triton-header {item!r}: expected KEY=VALUE")
        headers[key.strip().lower()] = value
    return headers or None


async def serve(args: argparse.Namespace, stop: Optional[asyncio.Event] = None) -> None:
    from aiohttp import web

    from . import sampling_defaults
    from .app import create_app
    from .service import Frontend
    from .tokenization import Tokenizer
    from .triton_grpc import TritonClient

    client = TritonClient(args.triton_url, _headers(args.triton_header))
    try:
        await client.wait_ready(args.wait_s)
        names = [n.strip() for n in args.triton_models.split(",") if n.strip()]
        targets, facts = await client.discover(names)
        if not targets:
            raise SystemExit(f"openai_frontend: error: none of {', '.join(names)} is loaded with text "
                             f"(text_input/text_output) or token (input_ids/output_ids) tensors")
        tokenizer_dir = args.tokenizer or facts.tokenizer_dir
        if not tokenizer_dir:
            raise SystemExit("openai_frontend: error: no tokenizer: the repository names none; give --tokenizer")
        template = Path(args.chat_template).read_text() if args.chat_template else None
        tokenizer = Tokenizer(tokenizer_dir, template, facts.add_special_tokens, facts.skip_special_tokens)
        try:
            defaults = sampling_defaults.load(args.generation_config, facts.model_dir or tokenizer_dir)
        except sampling_defaults.SamplingDefaultsError as e:
            raise SystemExit(f"openai_frontend: error: {e}") from None
        log.info("sampling for fields a request leaves out: %s", (
            f"{sampling_defaults.describe(defaults)} (the model's generation_config.json), then OpenAI's"
            if defaults else "OpenAI's (temperature 1, top_p 1)"))
        frontend = Frontend(client, targets, tokenizer, facts, alias=args.served_model_name,
                            sampling_defaults=defaults)
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        runner = web.AppRunner(create_app(frontend, api_key), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("serving %s (%s) on http://%s:%d/v1 for Triton at %s%s", ", ".join(frontend.names),
                 ", ".join(f"{t.name}: {t.kind}" for t in targets), args.host, args.port, args.triton_url,
                 "; API key required" if api_key else "")
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            await runner.cleanup()
    finally:
        await client.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s openai_frontend %(levelname)s %(message)s",
                        stream=sys.stderr)

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    try:
        asyncio.run(run())
    except RuntimeError as e:  # Triton never became ready
        log.error("%s", e)
        return 1
    return 0
