"""Checkpoints: tensors in safetensors, everything else in JSON; never pickle.

A checkpoint is a folder ``RUN/ckpt-STEP/`` (``model.safetensors``, ``optimizer.safetensors``,
``state.json`` with the step, config, RNG state and the files' sha256), written under a temporary
name and renamed; ``RUN/latest.json`` then names it (written atomically). A reader trusts only
what ``latest.json`` names and checks the checksums, so a killed save is never loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from teralm.errors import CheckpointError
from teralm.files import folder_lock, sha256_file, write_atomic
from teralm.kernels.fp8 import E4M3, quantize_fp8

LATEST = "latest.json"
LOCK = ".lock"  # held by the process that writes the run
KEEP = 2
NAME = re.compile(r"ckpt-\d{8,}")  # the only folders latest.json may name
# what save() writes in state.json, and the JSON type of each
STATE_FIELDS = {
    "step": int,
    "config": dict,
    "index": dict,
    "tokens": int,
    "wall_s": (int, float),
    "optimizer": dict,
    "files": dict,
}
WEIGHT_FILES = ("model.safetensors", "optimizer.safetensors")


def read_json(path: Path, advice: str) -> dict:
    """The JSON object in ``path``; a CheckpointError naming the file and ending in ``advice`` when
    it cannot be read or is not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({e}); {advice}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is damaged (not a JSON object); {advice}")
    return data


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The optimizer's state as (named tensors, JSON-able rest)."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for i, slots in state["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{i}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict, rest: dict) -> None:
    state: dict = {}
    for key, value in tensors.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = value
    for key, value in rest["scalars"].items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": rest["param_groups"]})


def save(
    run: Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    state: dict,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``run`` and point ``latest.json`` at it; ``extra`` tensors
    (each training process's own state) are stored beside the optimizer's."""
    final = run / f"ckpt-{step:08d}"
    tmp = run / f".ckpt-{step:08d}.tmp{os.getpid()}"
    for partial in run.glob(".ckpt-*.tmp*"):  # this save's, or one a killed run left behind
        shutil.rmtree(partial, ignore_errors=True)
    try:
        _write(tmp, model, optimizer, state, step, extra)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        before = latest(run)
        kept = f"{before.name} is intact" if before else "no earlier checkpoint was written"
        raise CheckpointError(
            f"cannot save checkpoint {final.name} ({_one_line(e)}); {kept}: free some space "
            "and resume the run with --resume"
        ) from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_atomic(run / LATEST, json.dumps({"checkpoint": final.name, "step": step}).encode())
    for old in sorted(run.glob("ckpt-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _write(tmp: Path, model, optimizer, state: dict, step: int, extra) -> None:
    """The files of a checkpoint in folder ``tmp``, synced."""
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, tmp / "model.safetensors")
    opt_tensors, opt_rest = optimizer_tensors(optimizer)
    opt_tensors["torch_rng"] = torch.get_rng_state()
    opt_tensors.update({k: v.contiguous() for k, v in (extra or {}).items()})
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    files = {
        name: sha256_file(tmp / name) for name in ("model.safetensors", "optimizer.safetensors")
    }
    record = {**state, "step": step, "optimizer": opt_rest, "files": files}
    (tmp / "state.json").write_text(json.dumps(record, indent=1))
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def lock_run(run: Path, worker: int | None = None) -> contextlib.AbstractContextManager:
    """Hold ``RUN/.lock`` (a DiLoCo ``worker``'s: ``RUN/.lock-worker{N}``) while this process
    writes the run (released when it ends, killed or not); a ``FolderBusy`` naming
    the holder when another process holds it."""
    name = LOCK if worker is None else f"{LOCK}-worker{worker}"
    return folder_lock(run, "teralm train", name)


def latest(run: Path) -> Path | None:
    """The checkpoint folder ``latest.json`` names, or None when the run has no checkpoint yet.

    Only the run's own ``ckpt-*`` folders are accepted (a plain name, resolving inside ``run``).
    """
    pointer = run / LATEST
    if not pointer.exists():
        return None
    advice = "point it at one of the run's ckpt-* folders, or delete it to start the run afresh"
    name = read_json(pointer, advice).get("checkpoint")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name!r}, not a ckpt-NNNNNNNN folder; {advice}")
    folder = run / name
    if folder.resolve().parent != run.resolve():
        raise CheckpointError(f"{pointer} names {folder}, which is outside the run; {advice}")
    return folder


def load_latest(run: Path, attempts: int = 5) -> tuple[Path, tuple[dict, dict, dict]]:
    """The checkpoint ``latest.json`` names and ``load``'s answer for it, read again when a
    writer moved on to a newer one (and removed this one) while it was being read: a DiLoCo
    worker that rejoins a run the others are still writing."""
    for _ in range(attempts - 1):
        folder = latest(run)
        try:
            return folder, load(folder)
        except ValueError:
            if latest(run) == folder:
                raise
    folder = latest(run)
    return folder, load(folder)


def load(folder: Path, optimizer: bool = True) -> tuple[dict, dict, dict]:
    """``(model tensors, optimizer tensors, state)``; CheckpointError naming a damaged file. Without
    ``optimizer`` its tensors are checked but not loaded (``{}``)."""
    path = folder / "state.json"
    earlier = [p.name for p in sorted(folder.parent.glob("ckpt-*")) if p.name < folder.name]
    advice = (
        f"point {LATEST} at an earlier checkpoint ({', '.join(earlier)}) and resume"
        if earlier
        else "start the run afresh (it has no earlier checkpoint)"
    )
    state = read_json(path, advice)
    bad = [k for k, kind in STATE_FIELDS.items() if not isinstance(state.get(k), kind)]
    if isinstance(state.get("files"), dict):
        bad += [f"files.{name}" for name in WEIGHT_FILES if name not in state["files"]]
    if bad:
        raise CheckpointError(f"{path} is damaged (missing or wrong: {', '.join(bad)}); {advice}")
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.exists() or sha256_file(file) != state["files"][name]:
            raise CheckpointError(
                f"checkpoint file {file} is missing, truncated or damaged; {advice}"
            )
    try:
        model = load_file(folder / "model.safetensors")
        moments = load_file(folder / "optimizer.safetensors") if optimizer else {}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {folder} cannot be read: {e}") from None
    return model, moments, state


EXPORT = "export.json"
EXPORT_WEIGHTS = "model-fp8.safetensors"


def is_fp8_export(path: Path) -> bool:
    return (Path(path) / EXPORT).exists()


def load_model_weights(path: Path) -> tuple[dict, dict]:
    """Weights and config of a run (its latest checkpoint), a checkpoint folder or an fp8 export:
    ``(tensors, state)``. An fp8 export's matrices come as stored: ``NAME`` in e4m3 beside its
    ``NAME.scale`` (``value = NAME / NAME.scale``)."""
    path = Path(path)
    if (path / LATEST).exists():
        path = latest(path)
    if (path / "model.safetensors").exists() and (path / "state.json").exists():
        tensors, _, state = load(path, optimizer=False)
        return tensors, state
    try:
        state = json.loads((path / EXPORT).read_text())
        tensors = load_file(path / EXPORT_WEIGHTS)
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(
            f"{path} is neither a run, a checkpoint nor an fp8 export ({e})"
        ) from None
    return tensors, state


def weights_sha256(path: Path) -> str:
    """The sha256 of the weights ``load_model_weights`` reads for ``path`` (a run, a checkpoint
    folder or an fp8 export): what a kNN datastore of the model's hidden states depends on."""
    path = Path(path)
    if (path / LATEST).exists():
        path = latest(path)
    if (path / "state.json").exists():  # the checksum the checkpoint recorded (load checks it)
        advice = "point latest.json at a complete checkpoint"
        files = read_json(path / "state.json", advice).get("files")
        sha = files.get("model.safetensors") if isinstance(files, dict) else None
        if not isinstance(sha, str):
            raise CheckpointError(
                f"{path / 'state.json'} names no checksum of its weights; {advice}"
            )
        return sha
    return sha256_file(path / EXPORT_WEIGHTS)


def export_fp8(model: torch.nn.Module, state: dict, out: Path) -> Path:
    """Write the model with every matrix in e4m3 (one byte per parameter) and its scale: one per
    tensor for Linear weights (the scale fp8 training used), one per row for embeddings."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in model.state_dict().items():
        value = value.detach().float().cpu()
        if value.ndim != 2:
            tensors[name] = value.contiguous()
            continue
        if "embed" in name:
            amax = value.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
            scale = torch.finfo(E4M3).max / amax
            q = (value * scale).to(E4M3)
        else:
            q, scale = quantize_fp8(value, E4M3)
        tensors[name] = q.contiguous()
        tensors[f"{name}.scale"] = (scale if scale.numel() > 1 else scale.reshape(1)).contiguous()
    tmp = out / f"{EXPORT_WEIGHTS}.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, out / EXPORT_WEIGHTS)
    write_atomic(
        out / EXPORT,
        json.dumps({"config": state["config"], "index": state.get("index")}).encode(),
    )
    return out
