"""A GGUF file (llama.cpp's format, how many small instruct models are published) into an ordinary
Hugging Face model folder, once, so everything downstream keeps seeing "a Hugging Face folder".

transformers reads GGUF itself (``from_pretrained(..., gguf_file=...)``, with the ``gguf`` and
``accelerate`` packages): it dequantises the weights to float32 and rebuilds the tokenizer, with its
chat template, from the file's metadata. Its GGUF quantizer stays attached to the model and makes
``save_pretrained`` refuse, so it is dropped before saving (the weights are already plain tensors).
The folder is written beside ``out`` under a temporary name and renamed into place: a failed
conversion leaves nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file cannot become a model folder (the operator's input: one line, exit 2)."""


def check_gguf(path: Path) -> Path:
    """``path`` if it is a readable file that starts with the GGUF magic, else GGUFError."""
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise GGUFError(f"{p}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{p}: not a GGUF file (it does not start with {GGUF_MAGIC.decode()})")
    return p


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def convert_gguf(path: Path, out: Path, *, replace: bool = False) -> tuple[Path, int]:
    """Write the HF folder of GGUF file ``path`` at ``out`` (which must not hold files unless
    ``replace``: then its files are replaced once the new folder is written); returns the folder and
    the model's parameter count. GGUFError when transformers cannot read the file, or it has no
    tokenizer."""
    from transformers.utils import logging as hf_logging

    src = check_gguf(path)
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not replace:
        raise GGUFError(f"{out} exists and is not empty (use --force to replace it)")
    where, name = str(src.parent), src.name
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings about a file it then refuses would bury the one line that says why
    try:
        return _convert(src, out, where, name)
    finally:
        hf_logging.set_verbosity(previous)


def _convert(src: Path, out: Path, where: str, name: str) -> tuple[Path, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import save_model_folder

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - transformers' many ways of saying "not a tokenizer I know"
        raise GGUFError(f"{src}: no tokenizer transformers can read in it ({_first_line(e)})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - an architecture or tensor layout transformers cannot map
        raise GGUFError(f"{src}: transformers cannot load it as a causal LM ({_first_line(e)})") from None
    # The weights are dequantised already. The quantizer blocks saving, and its config, written into
    # config.json, would attach it again to every load of the folder (a trainer could not save a step).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        tmp.chmod(0o777 & ~umask)  # a folder as mkdir makes it, not mkdtemp's owner-only one
        save_model_folder(model, tokenizer, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, sum(p.numel() for p in model.parameters())


def is_gguf_path(source: str) -> bool:
    """Whether a ``[run] model`` value names a GGUF file (by its suffix) rather than a folder."""
    return str(source).lower().endswith(".gguf")


def check_model_source(source: str) -> Path:
    """A ``[run] model`` value checked as what it names: a GGUF file or a model folder. GGUFError or
    ModelFolderError (both ValueError) says what is wrong."""
    from .model import check_model_folder

    return check_gguf(Path(source)) if is_gguf_path(source) else check_model_folder(source)
