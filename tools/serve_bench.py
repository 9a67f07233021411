"""Server overhead: tokens/s of concurrent streaming clients of `tango-lm serve` against
`serve.generate.generate` at the same batch size, on the same machine, rounds alternating.

Each round, the benchmark first decodes `--clients` copies of the prompt with `generate` in this
process (the engine of `tango-lm generate --num-samples N`), then lets `--clients` streaming
`openai` clients send one request each to the server (a subprocess with the same number of
threads). Both decode greedily until every row has ended (end-of-text or `--max-tokens`), and both
count the tokens of each row before its end (the end-of-text itself is not counted, as the server's
usage does not count it). The clients run on this machine too, so their HTTP
and JSON work is counted against the server. Prints the median tokens/s of each and their ratio,
and (on Linux) tokens per CPU-second of the generating process and of the server process: the
overhead without the clients and other programs competing for the cores.

    python tools/serve_bench.py [RUN] [--clients 8] [--max-tokens 128] [--rounds 5] [--threads N]

Without RUN it serves a randomly initialized TANGO the size of `tango-lm bench`'s (d = 256,
width 8192, depth 4) with the GPT-2 vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from tango_lm.data.tokenizers import get_tokenizer, tokenizer_from_dict
from tango_lm.serve.generate import generate
from tango_lm.train.checkpoint import load_checkpoint, save_checkpoint
from tango_lm.train.config import RunConfig

PROMPT = "The history of the city begins with a small settlement on the river, where"


def random_checkpoint(root: Path) -> Path:
    tok = get_tokenizer("gpt2")
    run = RunConfig.from_dict(
        {
            "model": {
                "arch": "tango",
                "d_model": 256,
                "width": 8192,
                "depth": 4,
                "vocab_size": tok.vocab_size,
                "context_length": 512,
            },
            "data": {"dir": str(root / "data")},
            "train": {"out_dir": str(root), "steps": 1},
        }
    )
    torch.manual_seed(0)
    model = run.model.build()
    return save_checkpoint(root / "checkpoints", 1, model.state_dict(), {}, run.to_dict(), tok.to_dict(), {})


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generate_round(model, tok, clients: int, max_tokens: int) -> tuple[float, int, float]:
    ids = tok.encode(PROMPT)
    prompt = torch.tensor([ids] * clients)
    t0, c0 = time.perf_counter(), time.process_time()
    out = generate(model, prompt, max_tokens, temperature=0, eos_id=tok.eot_id)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = 0
    for row in out[:, len(ids) :].tolist():
        # the server's usage.completion_tokens: the tokens before the end-of-text, not it
        tokens += row.index(tok.eot_id) if tok.eot_id in row else len(row)
    return seconds, tokens, cpu


async def server_round(url: str, model_name: str, clients: int, max_tokens: int) -> tuple[float, int]:
    import openai

    api = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one() -> int:
        stream = await api.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(clients)))
    seconds = time.perf_counter() - t0
    await api.close()
    return seconds, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", help="run or step directory (default: a random TANGO)")
    parser.add_argument(
        "--clients",
        type=int,
        default=8,
        help="concurrent streaming clients, and generate's batch (default %(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per request at most (default %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed rounds, alternating generate and the server (default %(default)s)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads of this process and of the server (default: PyTorch's choice)",
    )
    parser.add_argument(
        "--batch-wait-ms", type=float, default=20.0, help="the server's --batch-wait-ms (default %(default)s)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.run) if args.run else random_checkpoint(Path(tmp))
        loaded = load_checkpoint(ckpt)
        model = loaded.build_model("cpu")
        tok = tokenizer_from_dict(loaded.tokenizer)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tango_lm.cli",
                "serve",
                str(ckpt),
                "--port",
                "0",
                "--model-name",
                "bench",
                "--device",
                "cpu",
                "--threads",
                str(args.threads),
                "--max-batch-size",
                str(max(args.clients, 1)),
                "--batch-wait-ms",
                str(args.batch_wait_ms),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            line = server.stdout.readline()
            url = line.split(" at ")[-1].strip()
            generate_round(model, tok, args.clients, 8)  # warm-up of both
            asyncio.run(server_round(url, "bench", args.clients, 8))
            rates: dict[str, list[float]] = {"generate": [], "server": []}
            per_cpu: dict[str, list[float]] = {"generate": [], "server": []}
            with urllib.request.urlopen(url.removesuffix("/v1") + "/health") as resp:
                batches_before = json.loads(resp.read())["batches"]
            for _ in range(args.rounds):
                seconds, tokens, cpu = generate_round(model, tok, args.clients, args.max_tokens)
                rates["generate"].append(tokens / seconds)
                per_cpu["generate"].append(tokens / cpu)
                c0 = cpu_seconds(server.pid)
                seconds, tokens = asyncio.run(server_round(url, "bench", args.clients, args.max_tokens))
                rates["server"].append(tokens / seconds)
                c1 = cpu_seconds(server.pid)
                if c0 is not None and c1 is not None and c1 > c0:
                    per_cpu["server"].append(tokens / (c1 - c0))
            with urllib.request.urlopen(url.removesuffix("/v1") + "/health") as resp:
                batches = json.loads(resp.read())["batches"] - batches_before
        finally:
            server.terminate()
            server.wait(timeout=30)
    cfg = model.config
    print(
        f"{cfg.arch} d={cfg.d_model} width={cfg.width} depth={cfg.depth} V={cfg.vocab_size}, {args.clients} rows, "
        f"up to {args.max_tokens} new tokens, greedy, {args.threads} threads, {args.rounds} rounds"
    )
    for name, values in rates.items():
        print(
            f"  {name:<9} median {statistics.median(values):9.1f} tokens/s  ({', '.join(f'{v:.0f}' for v in values)})"
        )
    print(
        f"  server / generate: {statistics.median(rates['server']) / statistics.median(rates['generate']):.3f}; "
        f"the server decoded the {args.rounds * args.clients} requests in {batches} batches"
    )
    if per_cpu["server"]:
        g, s = statistics.median(per_cpu["generate"]), statistics.median(per_cpu["server"])
        print(f"  tokens per CPU-second: generate {g:.1f}, server process {s:.1f} (server / generate {s / g:.3f})")


if __name__ == "__main__":
    main()
