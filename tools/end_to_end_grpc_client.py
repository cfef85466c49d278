#!/usr/bin/env python3
"""Sends one prompt to the ensemble (or `tensorrt_llm_bls`) over gRPC and prints the text.

    python3 tools/end_to_end_grpc_client.py -p "What is ML?" -o 64 --streaming
    python3 tools/end_to_end_grpc_client.py -u localhost:8001 -p "Hi" --temperature 0.8 --seed 1
    python3 tools/end_to_end_grpc_client.py -p "Hi" -o 500 --streaming --model-name tensorrt_llm_bls

Always uses a gRPC stream (the models are decoupled); with `--streaming` the text is
printed piece by piece as it arrives, otherwise once at the end. Answers have
TensorRT-LLM's shapes: `text_output` is one string per response (`[1]`), the perf
metrics `[1, 1]`; a stream never repeats the prompt, so `--include-input` prints it
first. Ctrl-C cancels the request (on `tensorrt_llm_bls` that ends it in the engine
too). Exits 1 on an error.
"""
from __future__ import annotations

import argparse
import queue
import sys

import numpy as np


PERF_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "arrival_time_ns",
                "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def build_inputs(args) -> list:
    import tritonclient.grpc as grpcclient

    named = {
        "text_input": (np.array([[args.prompt.encode("utf-8")]], dtype=object), "BYTES"),
        "max_tokens": (np.array([[args.output_len]], dtype=np.int32), "INT32"),
        "stream": (np.array([[args.streaming]], dtype=np.bool_), "BOOL"),
        "exclude_input_in_output": (np.array([[not args.include_input]], dtype=np.bool_), "BOOL"),
        "bad_words": (np.array([[args.bad_words.encode()]], dtype=object), "BYTES"),
        "stop_words": (np.array([[args.stop_words.encode()]], dtype=object), "BYTES"),
        "temperature": (np.array([[args.temperature]], dtype=np.float32), "FP32"),
        "top_k": (np.array([[args.top_k]], dtype=np.int32), "INT32"),
        "top_p": (np.array([[args.top_p]], dtype=np.float32), "FP32"),
        "return_perf_metrics": (np.array([[args.perf_metrics]], dtype=np.bool_), "BOOL"),
    }
    if args.seed is not None:
        named["seed"] = (np.array([[args.seed]], dtype=np.uint64), "UINT64")
    if args.end_id is not None:
        named["end_id"] = (np.array([[args.end_id]], dtype=np.int32), "INT32")
    if args.speculative_method:
        named["speculative_method"] = (np.array([[args.speculative_method.encode()]], dtype=object), "BYTES")
    inputs = []
    for name, (array, datatype) in named.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-u", "--url", default="localhost:8001", help="gRPC endpoint")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-o", "--output-len", type=int, default=100)
    p.add_argument("--streaming", action="store_true", help="print pieces as they arrive")
    p.add_argument("--stop-words", default="", help="comma-separated")
    p.add_argument("--bad-words", default="", help="comma-separated")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filtering; 1: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="0: unset (TensorRT-LLM's convention)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--end-id", type=int, default=None)
    p.add_argument("--speculative-method", default=None, help="per-request override")
    p.add_argument("--include-input", action="store_true", help="print the prompt too")
    p.add_argument("--perf-metrics", action="store_true", help="print acceptance counters")
    p.add_argument("--model-name", default="ensemble", choices=("ensemble", "tensorrt_llm_bls"),
                   help="tensorrt_llm_bls: a cancelled request (Ctrl-C) also ends in the engine")
    args = p.parse_args(argv)

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    pieces, last, cancel = [], None, False
    if args.streaming and args.include_input:
        print(args.prompt, end="", flush=True)
    try:
        try:
            client.async_stream_infer(args.model_name, build_inputs(args), enable_empty_final_response=True)
        except InferenceServerException:  # the stream broke (no server?): the callback has the reason
            pass
        while True:
            result, error = results.get()
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")  # [1]: one string per response
            if text is not None:
                pieces.append(text[0].decode("utf-8"))
                last = result
                if args.streaming:
                    print(pieces[-1], end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except KeyboardInterrupt:
        cancel = True
        return 130
    finally:
        client.stop_stream(cancel_requests=cancel)
        client.close()
    print("" if args.streaming else "".join(pieces))
    if args.perf_metrics and last is not None:
        for name in PERF_OUTPUTS:
            print(f"{name}: {last.as_numpy(name)[0][0]}", file=sys.stderr)  # [1, 1] each
    return 0


if __name__ == "__main__":
    sys.exit(main())
