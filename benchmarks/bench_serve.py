"""Serving benchmark on the CPU: teralm (in-process and over HTTP) beside Hugging Face transformers.

    pip install -e '.[bench]'
    python benchmarks/bench_serve.py [--clients 32] [--seconds 60] [--max-tokens 32] [--steps 30]

Uses the tiny run that benchmarks/bench_quality.py trains, or else trains a short one (``--steps``)
with the pydocs index. The systems get the same token prompts:
- HF: ``GPT2LMHeadModel`` of the run's dimensions, random weights, fp32, greedy ``generate()``;
- teralm in-process: the model and index loaded as ``teralm serve`` does, driving its ``Engine``,
  without drafts (``--speculate 0``) and with the default;
- teralm over HTTP: a ``teralm serve`` subprocess on 127.0.0.1, default settings.

Prompts come from held-out pydocs documents, which the index holds (its drafts then follow the
document itself: the best case for speculation), and from novel text the index does not hold (this
Python's standard-library sources). For each system: single-stream tokens/s on each kind (after
the first token, ``--stream-tokens`` greedy, the mean over four prompts), batched
tokens/s (``--clients`` prompts at once, ``--max-tokens`` each) and the time to first token for a
100-token prompt (median of ``--repeats``), new to the system (sharing no prefix with any prompt
before it) and seen before (teralm's prefix cache then holds it); in-process, also whole sampled
completions (temperature 0.8, top-k 40) with the drafts kept. Then ``--clients`` concurrent HTTP
clients send completions for ``--seconds``, twice: cycling through the ~40 prompts above (a
service whose requests share prompts) and with every prompt new (no two alike). For each:
throughput, p50/p99 latency, errors, the share of the engine's time spent in index lookups and
of the prompt tokens served from the prefix cache (from /metrics). Prints the tables and the
targets, writes benchmarks/results/bench_serve.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from common import CACHE, corpus_index, save, serve_process, table, teralm_cli

from teralm.infer.precision import inference_threads

QUALITY = CACHE / "quality"
WORK = CACHE / "serve"
PROMPT_TOKENS, TTFT_PROMPT_TOKENS = 64, 100
NOVEL_SOURCES = ["argparse.py", "textwrap.py", "json/decoder.py", "csv.py"]


# -- the run and the prompts -------------------------------------------------------------------


def trained_run(steps: int) -> tuple[Path, Path]:
    """(run, index): bench_quality's tiny run when there is one, else a tiny run of ``steps``
    steps trained here on the pydocs index (random-ish weights are fine for speed)."""
    if (QUALITY / "run-index" / "latest.json").exists():
        return QUALITY / "run-index", QUALITY / "index"
    run = WORK / "run"
    _, index = corpus_index("pydocs")
    if not (run / "latest.json").exists():
        cmd = ["train", "--index", index, "--out", run, "--preset", "tiny", "--quiet"]
        teralm_cli(*cmd, "--max-steps", steps)
    return run, index


def novel_prompts(index: Path, length: int) -> list[list[int]]:
    """Token prompts of ``length`` from text the index does not hold: this Python's own
    standard-library sources (pydocs documents the library, it does not contain its code)."""
    import sysconfig

    from teralm.index import Index

    ix = Index.open(index)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in NOVEL_SOURCES:
        text = (stdlib / name).read_text(encoding="utf-8")
        prompts.append([int(t) for t in ix.encode(text[2000:])][:length])
    return prompts


def held_out_prompts(
    index: Path, length: int, per_document: int = 1, skip: int = 100
) -> list[list[int]]:
    """Token prompts of ``length`` from the held-out documents (every 50th): up to
    ``per_document`` consecutive ones from each, from its token ``skip`` on."""
    from teralm.index import Index

    ix = Index.open(index)
    prompts = []
    for d in range(0, ix.num_documents, 50):
        a, b = ix.document_range(d)
        starts = range(a + skip, b - length, length)[:per_document]
        prompts += [ix.tokens(s, s + length).tolist() for s in starts]
    return prompts


# -- the three systems --------------------------------------------------------------------------


class System(Protocol):
    name: str

    def stream(self, prompt: list[int], n: int) -> list[float]:
        """Greedy completion of ``n`` tokens: seconds from the call to each new token."""

    def batch(self, prompts: list[list[int]], n: int) -> int:
        """Greedy completions of ``n`` tokens for all ``prompts`` at once: tokens made."""


class HFBaseline:
    """``GPT2LMHeadModel`` with the run's dimensions, random weights, fp32, greedy ``generate()``
    with its KV cache."""

    name = "HF transformers GPT-2"

    def __init__(self, model_config: dict):
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            sys.exit("the HF baseline needs transformers: pip install -e '.[bench]'")

        config = GPT2Config(
            vocab_size=model_config["vocab_size"],
            n_positions=model_config["max_seq_len"],
            n_embd=model_config["d_model"],
            n_layer=model_config["n_layer"],
            n_head=model_config["n_head"],
            bos_token_id=0,
            eos_token_id=None,  # no early stop: every sequence makes max_new_tokens
            pad_token_id=0,
        )
        self.model = GPT2LMHeadModel(config).eval()

    def _generate(
        self, prompts: list[list[int]], n: int, streamer: TokenClock | None = None
    ) -> torch.Tensor:
        """Greedy completions of left-padded ``prompts``; the new tokens [batch, n]."""
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                use_cache=True,
                streamer=streamer,
            )
        return out[:, width:]

    def stream(self, prompt: list[int], n: int) -> list[float]:
        clock = TokenClock()
        self._generate([prompt], n, clock)
        return clock.times

    def batch(self, prompts: list[list[int]], n: int) -> int:
        return self._generate(prompts, n).numel()


class TokenClock:
    """A ``generate()`` streamer: seconds from its creation to each new token (the first
    ``put`` is the prompt)."""

    def __init__(self):
        self.began, self.times, self.prompt_seen = time.perf_counter(), [], False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter() - self.began)
        self.prompt_seen = True

    def end(self) -> None:
        pass


class InProcess:
    """The model and index loaded as ``teralm serve`` does, driving its ``Engine`` directly."""

    def __init__(self, run: Path, index: Path, max_batch: int, speculate: int | None = None):
        from teralm.index import Index
        from teralm.infer.engine import Engine
        from teralm.infer.load import check_tokenizer, load_model
        from teralm.infer.precision import default_device

        ix = Index.open(index)
        model, state, _ = load_model(run, default_device(), generating=True)
        check_tokenizer(state, ix)
        ix.query.longest_match([[0]])  # compile and warm the query kernels, as serve does
        self.engine = Engine(model, ix, max_batch=max_batch, speculate=speculate)
        drafts = "" if speculate is None else f", --speculate {speculate}"
        self.name = f"teralm in-process{drafts}"

    def _complete(self, prompts: list[list[int]], n: int) -> list[list[float]]:
        """Submit greedy completions of ``prompts`` at once; seconds to each new token of each."""
        from teralm.infer.engine import Sequence, TokenEvent
        from teralm.infer.sampling import Sampling

        began = time.perf_counter()
        times: list[list[float]] = [[] for _ in prompts]
        errors: list[str] = []
        finished = threading.Semaphore(0)

        def listener(k: int) -> Callable[[TokenEvent], None]:
            def on_event(event: TokenEvent) -> None:
                if event.token is not None and not event.prompt:
                    times[k].append(time.perf_counter() - began)
                if event.error:
                    errors.append(event.error)
                if event.finish:
                    finished.release()

            return on_event

        self.engine.submit(
            [
                Sequence(p, Sampling(max_tokens=n, temperature=0.0), listener(k))
                for k, p in enumerate(prompts)
            ]
        )
        for _ in prompts:
            if not finished.acquire(timeout=600):
                raise TimeoutError("the engine did not finish within 600 s")
        if errors:
            raise RuntimeError(f"the engine failed: {errors[0]}")
        return times

    def stream(self, prompt: list[int], n: int) -> list[float]:
        return self._complete([prompt], n)[0]

    def batch(self, prompts: list[list[int]], n: int) -> int:
        return sum(map(len, self._complete(prompts, n)))

    def close(self) -> None:
        self.engine.close()


class OverHTTP:
    """A ``teralm serve`` subprocess: streamed or plain completions on /v1/completions."""

    def __init__(self, port: int, name: str = "teralm over HTTP"):
        self.port, self.name = port, name

    def stream(self, prompt: list[int], n: int) -> list[float]:
        began = time.perf_counter()
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        conn, response = post(self.port, body)
        times = []
        for line in response:
            if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter() - began)
        conn.close()
        return times

    def batch(self, prompts: list[list[int]], n: int) -> int:
        made = [0] * len(prompts)

        def client(k: int) -> None:
            body = {"prompt": prompts[k], "max_tokens": n, "temperature": 0}
            conn, response = post(self.port, body)
            answer = json.loads(response.read())
            conn.close()
            made[k] = answer["usage"]["completion_tokens"] if response.status == 200 else 0

        concurrently(client, len(prompts))
        return sum(made)


def sampled(engine: InProcess, prompts: dict[str, list[list[int]]], n: int) -> list[dict]:
    """Whole sampled completions (temperature 0.8, top-k 40, ``n`` tokens, prefill included)
    one at a time in-process: tokens/s and the drafts kept, per kind of prompt."""
    from teralm.infer.sampling import Sampling

    rows, stats = [], engine.engine.stats
    for kind, group in prompts.items():
        drafted, kept = stats.drafted, stats.accepted
        began = time.perf_counter()
        for i, prompt in enumerate(group):
            engine.engine.generate(
                [prompt], Sampling(max_tokens=n, temperature=0.8, top_k=40, seed=i)
            )
        rows.append({
            "system": engine.name, "prompts": kind,
            "tok_per_s": len(group) * n / (time.perf_counter() - began),
            "kept_drafts": f"{stats.accepted - kept}/{stats.drafted - drafted}",
        })  # fmt: skip
    return rows


def measure(
    system: System,
    prompts: list[list[int]],
    novel: list[list[int]],
    ttft_prompts: list[list[int]],
    args: argparse.Namespace,
) -> dict:
    """Single-stream tokens/s (mean over the held-out and over the novel prompts), batched
    tokens/s, and the median time to first token for prompts new to the system (each of
    ``ttft_prompts`` once) and for one it has seen (the first again)."""
    system.stream(prompts[0], 8)  # warm up

    def single(prompt: list[int]) -> float:
        times = system.stream(prompt, args.stream_tokens)
        return (len(times) - 1) / (times[-1] - times[0])

    held_out = statistics.mean(single(p) for p in prompts[: len(novel)])
    novel_rate = statistics.mean(single(p) for p in novel)
    began = time.perf_counter()
    made = system.batch(prompts[: args.clients], args.max_tokens)
    batch_s = time.perf_counter() - began
    ttft = statistics.median(system.stream(p, 1)[0] for p in ttft_prompts[: args.repeats])
    seen = statistics.median(system.stream(ttft_prompts[0], 1)[0] for _ in range(args.repeats))
    print(f"  {system.name}: done", flush=True)
    row = {
        "system": system.name,
        "single_tok_per_s": held_out,
        "novel_tok_per_s": novel_rate,
        "batch_tok_per_s": made / batch_s,
        "ttft_ms": ttft * 1e3,
        "ttft_seen_ms": seen * 1e3,
    }
    if isinstance(system, InProcess):
        stats = system.engine.stats
        row["kept_drafts"] = f"{stats.accepted}/{stats.drafted}"
    return row


# -- the server and the sustained load ----------------------------------------------------------


def concurrently(work: Callable[[int], None], n: int) -> float:
    """Run ``work(0) .. work(n - 1)`` in ``n`` threads; the wall seconds until all are done."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - began


def post(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST ``body`` to /v1/completions; the open connection and its response."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def metrics(port: int) -> dict[str, float]:
    """The server's /metrics samples by name."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def load(
    port: int, prompts: list[list[int]], clients: int, seconds: float, max_tokens: int
) -> dict:
    """``clients`` clients each sending completions (temperature 0.8) for ``seconds``, the
    prompts in turn (repeating once all are sent)."""
    latencies, errors, tokens = [], [0], [0]
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            began = time.perf_counter()
            body = {
                "prompt": prompts[i % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "seed": i,
            }
            try:
                conn, response = post(port, body)
                answer = json.loads(response.read())
                conn.close()
                ok = response.status == 200
            except OSError:
                ok, answer = False, {}
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - began)
                    tokens[0] += answer["usage"]["completion_tokens"]
                else:
                    errors[0] += 1
            i += clients

    before = metrics(port)
    wall = concurrently(client, clients)
    after = metrics(port)
    spent = {k: after[k] - before[k] for k in after if k.endswith("_seconds_total")}
    lookup = spent["teralm_index_lookup_seconds_total"]
    model = spent["teralm_model_seconds_total"]
    lat = np.array(latencies) * 1e3
    return {
        "clients": str(clients),
        "prompts": len(prompts),
        "requests": len(latencies),
        "errors": errors[0],
        "tok_per_s": tokens[0] / wall,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "lookup_share": lookup / max(lookup + model, 1e-9),
        "cached_share": prompt_cached_share(before, after),
    }


def prompt_cached_share(before: dict[str, float], after: dict[str, float]) -> float:
    """The share of the prompt tokens read between two /metrics readings whose keys and
    values came from the prefix cache."""
    read = after["teralm_prompt_tokens_total"] - before["teralm_prompt_tokens_total"]
    cached = (
        after["teralm_prompt_tokens_cached_total"] - before["teralm_prompt_tokens_cached_total"]
    )
    return cached / max(read, 1)


# -- the report ---------------------------------------------------------------------------------


def targets(rows: list[dict], loads: list[dict]) -> list[dict]:
    """The issue's targets for teralm over HTTP (``rows``: HF, in-process, HTTP; ``loads``: the
    sustained loads), each with its value and pass/fail."""
    hf, http_row = rows[0], rows[-1]
    ratio = http_row["single_tok_per_s"] / hf["single_tok_per_s"]
    checks = [
        (
            "HTTP single stream >= 500 tokens/s",
            f"{http_row['single_tok_per_s']:.0f}",
            http_row["single_tok_per_s"] >= 500,
        ),
        ("HTTP single stream >= 1.5x HF in-process", f"{ratio:.2f}x", ratio >= 1.5),
        *(
            (
                f"{x['clients']} HTTP clients >= 3,000 tokens/s, 0 errors ({x['prompts']} prompts)",
                f"{x['tok_per_s']:.0f}, {x['errors']} errors",
                x["tok_per_s"] >= 3000 and x["errors"] == 0,
            )
            for x in loads
        ),
        (
            f"HTTP time to first token <= 20 ms ({TTFT_PROMPT_TOKENS}-token prompt, new)",
            f"{http_row['ttft_ms']:.1f} ms",
            http_row["ttft_ms"] <= 20,
        ),
    ]
    return [{"target": t, "value": v, "result": "pass" if ok else "FAIL"} for t, v, ok in checks]


def report(
    run: Path, rows: list[dict], loads: list[dict], checks: list[dict], args: argparse.Namespace
) -> None:
    """Print the systems' table, the sustained load's and the targets'."""
    threads = torch.get_num_threads()
    print(
        f"\ntiny model ({run}) with the pydocs index, torch threads: {threads}; "
        f"{PROMPT_TOKENS}-token prompts from held-out documents; greedy; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        table(
            rows,
            [
                ("system", "system", "s"),
                ("single_tok_per_s", f"1 stream tok/s ({args.stream_tokens}), held-out", ".1f"),
                ("novel_tok_per_s", "1 stream tok/s, novel", ".1f"),
                ("batch_tok_per_s", f"{args.clients} prompts tok/s ({args.max_tokens})", ".1f"),
                ("ttft_ms", f"TTFT ms ({TTFT_PROMPT_TOKENS} tok, new)", ".1f"),
                ("ttft_seen_ms", "TTFT ms (seen)", ".1f"),
                ("kept_drafts", "drafts kept", "s"),
            ],
        )
    )
    print(
        f"\n{args.clients} concurrent HTTP clients for {args.seconds:.0f} s each, temperature 0.8:"
        " prompts in turn, then every prompt new"
    )
    print(
        table(
            loads,
            [
                ("clients", "clients", "s"),
                ("prompts", "prompts", "d"),
                ("requests", "requests", "d"),
                ("errors", "errors", "d"),
                ("tok_per_s", "tokens/s", ".1f"),
                ("p50_ms", "p50 ms", ".0f"),
                ("p99_ms", "p99 ms", ".0f"),
                ("lookup_share", "lookup share", ".1%"),
                ("cached_share", "prompt cached", ".1%"),
            ],
        )
    )
    print()
    print(table(checks, [("target", "target", "s"), ("value", "value", "s"), ("result", "", "s")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="default: bench_quality's, or one trained here")
    parser.add_argument("--index", type=Path, help="the run's index (with --run)")
    parser.add_argument("--steps", type=int, default=30, help="steps of a run trained here")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=32, help="per batched completion")
    parser.add_argument("--stream-tokens", type=int, default=128, help="of the single stream")
    parser.add_argument("--repeats", type=int, default=5, help="time-to-first-token tries")
    args = parser.parse_args()
    if (args.run is None) != (args.index is None):
        sys.exit("give --run and --index together")
    run, index = (args.run, args.index) if args.run else trained_run(args.steps)
    if not (run / "latest.json").exists():
        sys.exit(f"no trained run at {run}")
    prompts = held_out_prompts(index, PROMPT_TOKENS, per_document=2)
    distinct = held_out_prompts(index, PROMPT_TOKENS, per_document=10**6)  # no two alike
    ttft_prompts = held_out_prompts(index, TTFT_PROMPT_TOKENS, skip=2000)  # sharing no prefix
    model_config = json.loads((run / "config.json").read_text())["config"]["model"]
    torch.set_num_threads(inference_threads())  # what `teralm serve` runs with, for all three

    novel = novel_prompts(index, PROMPT_TOKENS)
    rows = [measure(HFBaseline(model_config), prompts, novel, ttft_prompts, args)]
    sampled_rows = []
    for speculate in (0, None):
        engine = InProcess(run, index, args.clients, speculate)
        rows.append(measure(engine, prompts, novel, ttft_prompts, args))
        kinds = {"held-out": prompts[: len(novel)], "novel": novel}
        sampled_rows += sampled(engine, kinds, args.stream_tokens)
        engine.close()
    with serve_process(run, index, "--max-batch", args.clients) as (port, _):
        rows.append(measure(OverHTTP(port), prompts, novel, ttft_prompts, args))
        loads = [
            load(port, group, args.clients, args.seconds, args.max_tokens)
            for group in (prompts, distinct)
        ]
    checks = targets(rows, loads)
    report(run, rows, loads, checks, args)
    print(
        f"\nsampled in-process, temperature 0.8, top-k 40, {args.stream_tokens} tokens per prompt"
    )
    columns = [("system", "system", "s"), ("prompts", "prompts", "s")]
    columns += [("tok_per_s", "tok/s", ".1f"), ("kept_drafts", "drafts kept", "s")]
    print(table(sampled_rows, columns))
    payload = {
        "systems": rows,
        "sampled": sampled_rows,
        "load": loads,
        "targets": checks,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "run": str(run),
        "model": model_config,
        "load_average": os.getloadavg(),
    }
    print(f"wrote {save('bench_serve', payload)}")


if __name__ == "__main__":
    main()
