"""Where the trainer keeps its model folders and its training state, written so a crash never tears them.

Layout under ``<data dir>/trainer/``:

    models/v<N>/        one ordinary Hugging Face folder per version (config, safetensors, tokenizer)
    state.pt            the training state of the newest saved step (model, optimizer, scheduler,
                        step, RNG): what ``kill -9`` + restart resumes from
    state.pt.sha256     the SHA-256 of the state.pt files that may be in place (the new one and,
                        until the new one is renamed in, the old one): a changed byte is refused

Both are written to a temporary name, fsynced, and renamed into place (POSIX rename is atomic), then
the directory is fsynced, so after a crash each path is either the old complete object or the new
complete one. The model folder of version N is complete before ``state.pt`` says step N, so a saved
state always has its folder (INTELLECT-2 writes a "stable" marker last for the same reason).

A model with a NaN or an infinity in any tensor is never written (:func:`write_model_folder`
checks the weights first) nor published (:func:`check_finite_folder`, run on the folder's files
before every publish, also catches a folder saved by an older version of this program): such a
checkpoint would poison every node that loads it (issue 14). Downloaders check again
(node/shards/finite.py), so the swarm refuses one even when a trainer's key signed it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..atomic import DataDirError, fsync_dir, write_atomic
from ..hashes import hasher
from ..shards.finite import non_finite_in_folder

MODELS = "models"
STATE = "state.pt"
STATE_SUM = STATE + ".sha256"
_VERSION_DIR = re.compile(r"^v(\d+)$")


class NonFiniteCheckpoint(ArithmeticError):
    """A model about to be written or published holds NaN or infinity: our bug (the training step
    checks its loss and gradients, node/rl/grpo.py), so it is never written or sent."""


def non_finite_tensors(state_dict: dict) -> list[str]:
    """Names of the floating-point tensors of ``state_dict`` holding a NaN or an infinity."""
    import torch

    return [k for k, v in state_dict.items()
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def check_finite_folder(folder: Path) -> None:
    """Raise :class:`NonFiniteCheckpoint` unless every tensor in the folder's safetensors is finite."""
    problems = non_finite_in_folder(Path(folder))
    if problems:
        raise NonFiniteCheckpoint(f"{folder}: " + "; ".join(problems))


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def model_dir(root: Path, version: int) -> Path:
    return Path(root) / MODELS / f"v{version}"


def versions_on_disk(root: Path) -> list[int]:
    base = Path(root) / MODELS
    if not base.is_dir():
        return []
    return sorted(int(m.group(1)) for p in base.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir())


def write_model_folder(root: Path, version: int, model, tokenizer, state_dict: dict | None = None,
                       dtype: str = "auto") -> Path:
    """Save ``model`` + ``tokenizer`` as the HF folder of ``version`` atomically; returns its path.

    ``state_dict``: full weights to write instead of the model's own (a sharded model's gathered state).
    ``dtype``: ``[trainer] publish_dtype``: the floating-point weights are written in it (and the
    folder's config says so, so a loader's "auto" picks it); "auto" keeps them as they are.
    """
    import torch

    from ..engines.model import portable_tokenizer_config, save_model_folder

    cast = getattr(torch, dtype) if dtype != "auto" else None
    if cast is not None:  # cast before the check: float16 overflows to infinity above 65,504
        state_dict = _cast(state_dict if state_dict is not None else model.state_dict(), cast)
    bad = non_finite_tensors(state_dict if state_dict is not None else model.state_dict())
    if bad:
        raise NonFiniteCheckpoint(f"v{version}: not written, {len(bad)} tensors hold NaN or infinity "
                                  f"({', '.join(bad[:4])})")
    final = model_dir(root, version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if state_dict is None:
        save_model_folder(model, tokenizer, tmp)
    else:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_config(tmp)
    if cast is not None:
        _set_config_dtype(tmp, dtype)
    _fsync_tree(tmp)
    if final.exists():  # a crash after the rename but before state.pt: the same step is redone
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def _cast(state_dict: dict, dtype) -> dict:
    """Floating tensors in ``dtype``; tensors that share storage (tied embeddings) still share it, so
    the tie is saved once, as from the model itself (SmolLM2's lm_head would add 57 MB)."""
    done: dict = {}
    out = {}
    for k, v in state_dict.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()))
        if key not in done:
            done[key] = v.to(dtype)
        out[k] = done[key]
    return out


def _set_config_dtype(folder: Path, dtype: str) -> None:
    """Name ``dtype`` in the folder's config.json (transformers 5 reads ``dtype``, 4.x ``torch_dtype``)."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prune_model_folders(root: Path, keep: int, protect: set[int] = frozenset()) -> list[int]:
    """Delete all but the newest ``keep`` version folders (and stray temporaries); returns those removed."""
    base = Path(root) / MODELS
    for tmp in base.glob("*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    held = versions_on_disk(root)
    doomed = [v for v in held[:-keep] if v not in protect] if keep > 0 else []
    for v in doomed:
        shutil.rmtree(model_dir(root, v), ignore_errors=True)
    return doomed


def save_state(root: Path, state: dict) -> Path:
    """``torch.save`` the training state atomically to ``<root>/state.pt``, with its checksum.

    The checksum file lists the new digest (and the old one) *before* the new state is renamed in,
    then only the new one: whenever the process dies, the state in place has its digest listed."""
    import torch

    root = Path(root)
    final = root / STATE
    tmp = root / (STATE + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    new = file_digest(tmp)
    old = _listed_digest(root) or (file_digest(final) if final.is_file() else None)  # no re-read when listed
    write_atomic(root / STATE_SUM, "".join(f"{d}\n" for d in (new, old) if d).encode())
    os.replace(tmp, final)
    fsync_dir(root)
    write_atomic(root / STATE_SUM, f"{new}\n".encode())
    return final


def _listed_digest(root: Path) -> str | None:
    """The digest of the state in place when the last save completed (a one-line list); None if
    unknown (a save cut short lists two, either of which may be in place)."""
    try:
        listed = (root / STATE_SUM).read_text().split()
    except OSError:
        return None
    return listed[0] if len(listed) == 1 else None


def file_digest(path: Path) -> str:
    h = hasher()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def load_state(root: Path) -> dict | None:
    """The saved training state, or None on first start."""
    import torch

    path = Path(root) / STATE
    if not path.is_file():
        return None
    fix = f"restore {path} from a backup, or move the trainer folder away to start from the base model"
    sums = Path(root) / STATE_SUM
    if sums.is_file():  # states saved before checksums existed have none: loaded as they are
        if file_digest(path) not in sums.read_text().split():
            raise DataDirError(f"training state {path} does not match its checksum: {fix}")
    try:
        # weights_only=False: the state holds RNG states and optimizer dicts we wrote ourselves.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 — torch raises many types for a truncated or foreign file
        raise DataDirError(f"training state {path} cannot be read ({type(e).__name__}: {e}): {fix}") from None
