"""An OpenAI-compatible front door for this repository's Triton server.

A small process in front of `tritonserver`: it speaks the OpenAI API (`/v1/models`,
`/v1/completions`, `/v1/chat/completions`, streamed or not) and talks to Triton over
gRPC streaming, one stream per generation, as Triton's own OpenAI frontend talks to
its in-process server. Modules, each owning one thing:

    protocol.py      request bodies -> `Generation` (validation, OpenAI's error shape)
    tokenization.py  chat template, prompt tokens, detokenizing token-level output
    triton_grpc.py   models and their tensors, input arrays, gRPC streams and cancellation
    stops.py         stop strings on streamed text
    responses.py     OpenAI's answer, chunk, usage and log-prob JSON
    service.py       one request end to end (no HTTP)
    merge.py         a request's choices, each on its own stream, read as one
    app.py           the aiohttp web layer (routes, API key, SSE)
    server.py        the command line

Run it with `python tools/openai_frontend ...` (see server.py) or let
`tools/launch_triton_server.py --openai_port N` start it with the server.
"""
