"""``RUN/metrics.jsonl``: a training record every ``log_every`` steps."""

from __future__ import annotations

import json
from pathlib import Path

from teralm.errors import ConfigError
from teralm.files import write_atomic

METRICS = "metrics.jsonl"


def _metric_step(line: str) -> int | None:
    """The step of a ``metrics.jsonl`` line, or None when it is not a metrics record."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metric lines of steps up to ``step`` (a resumed run redoes the rest); a last
    line cut short (the process was killed while writing it) is dropped."""
    if not path.exists():
        return
    kept, text = [], path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n") and _metric_step(lines[-1]) is None:
        lines.pop()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        line_step = _metric_step(line)
        if line_step is None:
            raise ConfigError(
                f"{path} line {number} is not a metrics record; delete that line and resume"
            )
        if line_step <= step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept).encode())


class MetricsLog:
    """The metrics file of a run resumed at step ``start`` (0: a new run), as ``kind`` says:
    ``"steps"``, each record written as it comes (the process that writes a data-parallel
    run); ``"rounds"``, a DiLoCo worker's records kept until their round is agreed
    (``end_round``); ``"none"``, nothing written (the other data-parallel processes)."""

    def __init__(self, path: Path, start: int, kind: str):
        self.path, self.kind, self.records = path, kind, []
        self.file = None
        if kind == "steps":
            truncate_metrics(path, start)
            self.file = open(path, "a")  # noqa: SIM115 (closed by close)

    def add(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        elif self.kind == "rounds":
            self.records.append(record)

    def end_round(self, start: int, keep: bool, outer) -> None:
        """A DiLoCo round from step ``start`` ended: with ``keep``, write its records with the
        workers in it (the last carries the bytes this worker sent in the round, the others 0),
        after dropping the lines past ``start`` (of a run killed before it was resumed)."""
        records, self.records = self.records, []
        if not keep:
            return
        truncate_metrics(self.path, start)
        with open(self.path, "a") as metrics:
            for i, record in enumerate(records, 1):
                sent = outer.round_sent if i == len(records) else 0
                record.update(sent_bytes=sent, received_bytes=sent, workers=outer.workers)
                metrics.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
