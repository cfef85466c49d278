"""What the OpenAI front door costs: output tokens/s through `/v1/chat/completions`
against the ensemble's own gRPC stream, side by side in one run.

    # a server of your own (tools/serve.sh, or launch_triton_server.py --openai_port 9000)
    python tools/bench/openai_overhead.py --grpc-url localhost:8001 --openai-url http://localhost:9000 \\
        --concurrency 1 16 --requests 64 --output-tokens 128 --repeats 3 --json-out overhead.json
    # or let it start one on free ports, with the front door
    python tools/build_model_repo.py --out /tmp/repo --method none
    python tools/bench/openai_overhead.py --launch /tmp/repo --concurrency 1 16

Routes, each fed the same chat prompts (the first turns of a question set, rendered
with the tokenizer's chat template for the gRPC route, as the front door renders them):

    grpc:ensemble          Triton's gRPC stream to the ensemble: the baseline
    openai:ensemble        the front door, to the same ensemble: only the front door's own cost
    openai:<model>         the front door to every other model it serves: tensorrt_llm_bls (what
                           an OpenAI client gets by default: listed first) and
                           speculative_decoding (token ids: no pre/postprocessing models)

Every request is greedy and generates exactly `--output-tokens` tokens (`min_tokens` =
`max_tokens`), so every route does the same engine work and tokens/s = requests x
output tokens / wall time. Per concurrency, each repeat runs every route once (the order
rotates between repeats); ratios are taken within a repeat against the gRPC baseline,
and their median is reported. Beside the rates, the CPU seconds the front door, the
server (tritonserver and its model processes, with --launch or --server-pid) and this
client used per route, per 1000 tokens: on a machine whose cores the engine needs, the
front door's CPU is where a loss would come from.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO / "backend_src", REPO / "tools", REPO / "tools" / "data", Path(__file__).resolve().parent):
    sys.path.insert(0, str(_path))

from openai_frontend.triton_grpc import TritonClient, build_inputs  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- CPU accounting


def _proc_table() -> dict[int, tuple[int, float]]:
    """{pid: (parent pid, CPU seconds)} of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return table


def tree_cpu(root: Optional[int], exclude: Optional[int] = None) -> float:
    """CPU seconds of `root` and its descendants (without `exclude`'s subtree); 0 without a root."""
    if root is None:
        return 0.0
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid == exclude or pid not in table:
            continue
        total += table[pid][1]
        todo.extend(children.get(pid, []))
    return total


def find_child(parent: int, marker: str) -> Optional[int]:
    """A child of `parent` whose command line holds `marker`."""
    for pid, (ppid, _) in _proc_table().items():
        if ppid == parent:
            try:
                if marker in (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace"):
                    return pid
            except OSError:
                continue
    return None


# ---------------------------------------------------------------- routes


@dataclass
class RouteRun:
    route: str
    concurrency: int
    tokens: int
    seconds: float
    ttft_ms: float  # mean time to the first streamed piece
    cpu_s: dict = field(default_factory=dict)  # {"front_door", "server", "client"}

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class GrpcRoute:
    """The baseline: one gRPC stream per request to a text model."""

    def __init__(self, client: TritonClient, target, prompts: list[str], n: int):
        self.client, self.target, self.prompts, self.n = client, target, prompts, n
        self.name = f"grpc:{target.name}"

    async def one(self, i: int) -> float:
        arrays = build_inputs(self.target, {"text_input": self.prompts[i % len(self.prompts)], "max_tokens": self.n,
                                            "min_tokens": self.n, "temperature": 0.0, "stream": True,
                                            "exclude_input_in_output": True})
        t0, first = time.perf_counter(), None
        stream = self.client.stream(self.target, arrays, f"bench-{i}", ["text_output"])
        try:
            async for piece in stream:
                if first is None and piece.text:
                    first = time.perf_counter() - t0
                if piece.final:
                    break
        finally:
            stream.close()
        return first or 0.0


class OpenAIRoute:
    """Streamed chat completions through the front door, read as a lean client reads SSE."""

    def __init__(self, session, url: str, model: str, messages: list[list[dict]], n: int, api_key: Optional[str]):
        self.session, self.url, self.model, self.messages, self.n = session, url, model, messages, n
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = f"openai:{model}"

    async def one(self, i: int) -> float:
        body = {"model": self.model, "messages": self.messages[i % len(self.messages)], "max_tokens": self.n,
                "min_tokens": self.n, "temperature": 0, "stream": True}
        t0, first = time.perf_counter(), None
        async with self.session.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    break
                if first is None and b'"content":"' in line and b'"content":""' not in line:
                    first = time.perf_counter() - t0
        return first or 0.0


async def run_route(route, concurrency: int, requests: int, cpu_pids: dict) -> RouteRun:
    """`requests` requests, `concurrency` at a time; wall time from the first start to the last end."""
    queue = list(range(requests))[::-1]
    ttfts: list[float] = []

    async def worker():
        while queue:
            ttfts.append(await route.one(queue.pop()))

    cpu0 = {k: tree_cpu(*v) for k, v in cpu_pids.items()}
    client0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    cpu = {k: tree_cpu(*v) - cpu0[k] for k, v in cpu_pids.items()}
    cpu["client"] = time.process_time() - client0
    return RouteRun(route.name, concurrency, requests * route.n, seconds, 1000 * statistics.mean(ttfts), cpu)


# ---------------------------------------------------------------- the run


def chat_prompts(question_set: Path, count: int) -> list[list[dict]]:
    from dataset_converter import read_question_set

    questions = read_question_set(question_set)[:count]
    return [[{"role": "user", "content": q.turns[0]}] for q in questions]


async def measure(args, cpu_pids: dict) -> list[RouteRun]:
    import aiohttp

    from openai_frontend.tokenization import Tokenizer

    client = TritonClient(args.grpc_url)
    await client.wait_ready(args.wait_s)
    targets, facts = await client.discover([args.triton_model])
    if not targets:
        raise SystemExit(f"openai_overhead: {args.triton_model} is not a text model on {args.grpc_url}")
    tokenizer = Tokenizer(args.tokenizer or facts.tokenizer_dir, add_special_tokens=facts.add_special_tokens)
    messages = chat_prompts(args.questions, args.prompts)
    rendered = [tokenizer.text_prompt(tokenizer.chat_prompt(m), templated=True) for m in messages]
    api_key = os.environ.get(args.api_key_env)
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{args.openai_url}/v1/models",
                               headers={"Authorization": f"Bearer {api_key}"} if api_key else {}) as r:
            served = [m["id"] for m in (await r.json())["data"]]
        routes = [GrpcRoute(client, targets[0], rendered, args.output_tokens)]
        for model in dict.fromkeys([args.triton_model] + (args.openai_models or served)):
            if model not in served:
                raise SystemExit(f"openai_overhead: the front door does not serve {model} (it serves {served})")
            routes.append(OpenAIRoute(session, args.openai_url, model, messages, args.output_tokens, api_key))
        for route in routes:  # warm-up: first requests load caches on both sides
            await run_route(route, 2, 2, {})
        runs = []
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                order = routes[repeat % len(routes):] + routes[:repeat % len(routes)]
                for route in order:
                    run = await run_route(route, concurrency, args.requests, cpu_pids)
                    print(f"c={concurrency} repeat {repeat + 1}: {run.route:28s} {run.tokens_per_s:8.1f} tok/s "
                          f"ttft {run.ttft_ms:7.1f} ms  cpu {json.dumps({k: round(v, 2) for k, v in run.cpu_s.items()})}",
                          file=sys.stderr)
                    runs.append(run)
    await client.close()
    return runs


def summarize(runs: list[RouteRun]) -> list[dict]:
    """One row per (concurrency, route): median tokens/s, median ratio to the gRPC baseline
    within a repeat, mean TTFT, CPU seconds per 1000 tokens."""
    rows = []
    for concurrency in dict.fromkeys(r.concurrency for r in runs):
        at = [r for r in runs if r.concurrency == concurrency]
        routes = list(dict.fromkeys(r.route for r in at))
        per_route = {name: [r for r in at if r.route == name] for name in routes}
        base = per_route[routes[0]]
        for name in routes:
            mine = per_route[name]
            ratios = [m.tokens_per_s / b.tokens_per_s for m, b in zip(mine, base)]
            tokens = sum(r.tokens for r in mine)
            rows.append({
                "concurrency": concurrency, "route": name,
                "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
                "ratio_to_grpc": statistics.median(ratios), "ratios": ratios,
                "ttft_ms": statistics.mean(r.ttft_ms for r in mine),
                "cpu_s_per_1k_tokens": {k: 1000 * sum(r.cpu_s.get(k, 0.0) for r in mine) / tokens
                                        for k in mine[0].cpu_s},
            })
    return rows


def format_rows(rows: list[dict]) -> str:
    cpu_keys = list(rows[0]["cpu_s_per_1k_tokens"])
    header = ["concurrency", "route", "tok/s", "vs grpc", "TTFT ms"] + [f"cpu {k} s/1k tok" for k in cpu_keys]
    body = [[str(r["concurrency"]), r["route"], f"{r['tokens_per_s']:.1f}", f"{r['ratio_to_grpc']:.3f}",
             f"{r['ttft_ms']:.1f}"] + [f"{r['cpu_s_per_1k_tokens'][k]:.2f}" for k in cpu_keys] for r in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def launch(repo: Path, log_dir: Path):
    """launch_triton_server.py with the front door, on free ports; returns (process, urls)."""
    import triton_env

    ports = {k: triton_env.free_port() for k in ("http", "grpc", "metrics", "openai")}
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "launch.log", "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "tools" / "launch_triton_server.py"), "--world_size=1", f"--model_repo={repo}",
             "--http_port", str(ports["http"]), "--grpc_port", str(ports["grpc"]),
             "--metrics_port", str(ports["metrics"]), "--openai_port", str(ports["openai"]),
             "--exit_timeout_secs", "3", "--log-file", str(log_dir / "server.log")],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"localhost:{ports['grpc']}", f"http://localhost:{ports['openai']}"


def wait_front_door(url: str, process, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"openai_overhead: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"openai_overhead: no front door at {url} after {timeout_s:.0f} s")


def main(argv=None) -> int:
    from dataset_converter import question_set_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", type=Path, default=None, metavar="REPO",
                   help="start launch_triton_server.py --openai_port on this filled repository")
    p.add_argument("--grpc-url", default="localhost:8001")
    p.add_argument("--openai-url", default="http://localhost:9000")
    p.add_argument("--triton-model", default="ensemble", help="the gRPC baseline (a text model)")
    p.add_argument("--openai-models", nargs="+", default=None,
                   help="measure the front door to these models too (default: every model it serves)")
    p.add_argument("--tokenizer", default=None, help="default: the repository's")
    p.add_argument("--questions", type=Path, default=question_set_path("humaneval"))
    p.add_argument("--prompts", type=int, default=64, help="how many of the set's first turns")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per route and repeat")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-pid", type=int, default=None, help="count this process tree's CPU as the server's")
    p.add_argument("--frontend-pid", type=int, default=None, help="count this process's CPU as the front door's")
    p.add_argument("--api-key-env", default="SPECDEC_API_KEY")
    p.add_argument("--wait-s", type=float, default=900)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)

    process = None
    if args.launch is not None:
        log_dir = REPO / ".cache" / "openai_overhead"  # the server's logs: not results, kept out of docs/
        process, args.grpc_url, args.openai_url = launch(args.launch.resolve(), log_dir)
    try:
        wait_front_door(args.openai_url, process, args.wait_s)
        frontend_pid = args.frontend_pid or (find_child(process.pid, "openai_frontend") if process else None)
        server_pid = args.server_pid or (process.pid if process else None)
        cpu_pids = {"front_door": (frontend_pid, None), "server": (server_pid, frontend_pid)}
        cpu_pids = {k: v for k, v in cpu_pids.items() if v[0] is not None}
        from bench import machine_info, portable

        runs = asyncio.run(measure(args, cpu_pids))
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    rows = summarize(runs)
    print(format_rows(rows))
    if args.json_out:
        report = {"machine": machine_info("cpu"), "args": {k: str(portable(v)) for k, v in vars(args).items()},
                  "rows": rows, "runs": [vars(r) | {"tokens_per_s": r.tokens_per_s} for r in runs]}
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
