"""lm-evaluation-harness against a real `teralm serve`, with its plain command line and no
tokenizer arguments (the server's /tokenizer_info, /tokenize and /detokenize answer for it).

    pip install "lm-eval[api]"   # 0.4.x; nothing is downloaded from the hub
    python benchmarks/bench_lm_eval.py [--run RUN --index INDEX] [--steps 60]

The tasks come from pydocs' reST sources: those with ``id % 50 == 0`` are unseen, the others
seen. Without ``--run`` it serves the tiny model of benchmarks/bench_quality.py when that exists
(its index holds every document, the unseen ones too), else builds a byte index of the seen
sources alone and trains the tiny preset on it for ``--steps`` steps. Three small local tasks
(JSONL data, task YAMLs with ``dataset_path: json``), one per request type, each run as

    lm_eval --model local-completions \\
            --model_args model=ID,base_url=http://127.0.0.1:PORT/v1/completions ...

- loglikelihood: multiple choice, the true second half of an unseen line against three others;
- loglikelihood_rolling: unseen passages, bits per byte, checked against the server's own
  ``echo`` scoring of the same text;
- generate_until: the rest of a line of seen text, with five stop strings.

Prints a table and writes benchmarks/results/bench_lm_eval.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import CACHE, PYDOCS, save, serve_process, table, teralm_cli

WORK = CACHE / "lm_eval"
QUALITY = CACHE / "quality"
UNSEEN_EVERY = 50  # pydocs' suggested split: documents with id % 50 == 0 are the test set
STOPS = ["\n", "\n\n", "```", ".. ", "\nclass "]  # more than OpenAI's 4, as humaneval sends

TASKS = {  # name: (request type, YAML lines after task and dataset, the metric reported)
    "teralm_choice": (
        "loglikelihood",
        """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc""",
        "acc",
    ),
    "teralm_rolling": (
        "loglikelihood_rolling",
        """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity""",
        "bits_per_byte",
    ),
    "teralm_generate": (
        "generate_until",
        f"""output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: {json.dumps(STOPS)}
  max_gen_toks: 48
  do_sample: false
metric_list:
  - metric: exact_match""",
        "exact_match",
    ),
}


def post(port: int, path: str, body: dict) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer


def sources() -> tuple[list[str], list[str]]:
    """The texts of pydocs' reST sources: (unseen, seen)."""
    if not PYDOCS.exists():
        sys.exit(f"{PYDOCS} not found: the benchmark reads the team's shared data folder")
    with gzip.open(PYDOCS, "rt") as f:
        docs = [d for d in map(json.loads, f) if d["path"].startswith("_sources/")]
    split = ([], [])
    for d in docs:
        split[bool(d["id"] % UNSEEN_EVERY)].append(d["text"])
    return split


def tiny_run(seen: list[str], steps: int) -> tuple[Path, Path]:
    """The tiny model and its index: bench_quality's, or a quick one on the ``seen`` texts."""
    if (QUALITY / "run-index" / "latest.json").exists():
        return QUALITY / "run-index", QUALITY / "index"
    run, index, data = WORK / "run", WORK / "index", WORK / "seen.jsonl"
    if not data.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps({"text": text}) + "\n" for text in seen))
    teralm_cli("build-index", data, "--out", index, "--quiet")  # done already: a quick check
    if not (run / "latest.json").exists():
        shutil.rmtree(run, ignore_errors=True)
        train = ["--index", index, "--out", run, "--preset", "tiny", "--max-steps", steps]
        teralm_cli("train", *train, "--quiet")
    return run, index


def lines_of(texts: list[str]) -> list[str]:
    """The lines of 40 to 100 characters."""
    lines = (line for text in texts for line in text.splitlines())
    return [line for line in lines if 40 <= len(line.strip()) <= 100]


def passages(texts: list[str], size: int) -> list[str]:
    """Consecutive whole lines, up to ``size`` characters each."""
    out = []
    for text in texts:
        current = ""
        for line in text.splitlines(keepends=True):
            if current and len(current) + len(line) > size:
                out.append(current)
                current = ""
            current += line[:size]
        out.append(current)
    return [p for p in out if p.strip()]


def multiple_choice(lines: list[str], rng: np.random.Generator) -> dict:
    """The first half of ``lines[0]``, its second half and the other lines' in random order."""
    halves = [(line[: len(line) // 2], line[len(line) // 2 :]) for line in map(str, lines)]
    order = rng.permutation(len(halves))
    return {
        "context": halves[0][0],
        "choices": [halves[k][1] for k in order],
        "label": int(np.flatnonzero(order == 0)[0]),
    }


def write_tasks(unseen: list[str], seen: list[str], folder: Path, items: int, size: int) -> dict:
    """The three tasks' data and YAML files in ``folder``: unseen text for the two scored by
    log-likelihood, seen text for generation. Returns the data."""
    rng = np.random.default_rng(0)

    def pick(xs: list, n: int = items) -> list:
        return [xs[i] for i in sorted(rng.choice(len(xs), n, replace=False))]

    shuffled = rng.permutation(pick(lines_of(unseen), 4 * items))
    data = {
        "teralm_choice": [multiple_choice(four, rng) for four in shuffled.reshape(items, 4)],
        "teralm_rolling": [{"text": p} for p in pick(passages(unseen, size))],
        "teralm_generate": [
            {"prompt": line[:30], "target": line[30:]} for line in pick(lines_of(seen[::7]))
        ],
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
            f"test_split: test\n{TASKS[name][1]}\n"
        )
    return data


def lm_eval(task: str, model: str, port: int, folder: Path) -> tuple[dict, float]:
    """One task through lm-eval's local-completions; its results and the wall seconds."""
    out = folder / "out" / task
    shutil.rmtree(out, ignore_errors=True)
    model_args = f"model={model},base_url=http://127.0.0.1:{port}/v1/completions"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
    cmd += ["--model_args", model_args, "--tasks", task]
    cmd += ["--include_path", str(folder), "--output_path", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    if done.returncode:
        sys.exit(f"lm_eval failed on {task}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    (results,) = out.glob("**/results_*.json")
    return json.loads(results.read_text()), wall


def server_bits_per_byte(port: int, texts: list[str]) -> float:
    """Bits per byte of ``texts`` from the server's own echo, each after a new line (lm-eval's
    prefix token)."""
    nats, size = 0.0, 0
    for text in texts:
        answer = post(
            port,
            "/v1/completions",
            {"prompt": "\n" + text, "max_tokens": 0, "echo": True, "logprobs": 0},
        )
        nats -= sum(answer["choices"][0]["logprobs"]["token_logprobs"][1:])
        size += len(text.encode())
    return nats / size / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path)
    parser.add_argument("--index", type=Path)
    parser.add_argument("--steps", type=int, default=60, help="training steps of a quick run")
    parser.add_argument("--items", type=int, default=20, help="documents per task")
    parser.add_argument("--size", type=int, default=160, help="characters per rolling passage")
    args = parser.parse_args()
    unseen, seen = sources()
    run, index = (args.run, args.index) if args.run else tiny_run(seen, args.steps)
    data = write_tasks(unseen, seen, WORK / "tasks", args.items, args.size)
    model, rows = f"teralm-{run.resolve().name}", []
    with serve_process(run, index) as (port, _):
        for task, (kind, _, metric) in TASKS.items():
            results, wall = lm_eval(task, model, port, WORK / "tasks")
            rows.append(
                {
                    "task": task,
                    "requests": kind,
                    "docs": results["n-samples"][task]["effective"],
                    "metric": metric,
                    "value": results["results"][task][f"{metric},none"],
                    "wall_s": wall,
                }
            )
        echo = server_bits_per_byte(port, [d["text"] for d in data["teralm_rolling"]])
    rows.append(
        {
            "task": "teralm_rolling",
            "requests": "server echo",
            "docs": args.items,
            "metric": "bits_per_byte",
            "value": echo,
        }
    )
    print(f"lm-eval local-completions against `teralm serve` ({run}), no tokenizer arguments")
    print(
        table(
            rows,
            [
                ("task", "task", "s"),
                ("requests", "request type", "s"),
                ("docs", "docs", "d"),
                ("metric", "metric", "s"),
                ("value", "value", ".4f"),
                ("wall_s", "wall s", ".1f"),
            ],
        )
    )
    print(f"wrote {save('bench_lm_eval', {'run': str(run), 'index': str(index), 'rows': rows})}")


if __name__ == "__main__":
    main()
