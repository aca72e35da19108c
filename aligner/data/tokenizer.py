"""Tokenizer loading: HF tokenizer dirs, tokenizer.json files and sentencepiece tokenizer.model files.

Owns: :func:`load_tokenizer` (local files only: no network, no ``trust_remote_code``), the
special-token fix-ups every stage relies on (bos / eos always set; pad = eos, else unk, when
the tokenizer has none) and the default chat template used when a tokenizer has none.

Simplifications: a lone tokenizer.json carries no tokenizer_config.json, so its special
tokens are recognized by their usual spellings (``<s>``/``<bos>``, ``</s>``/``<eos>``,
``<unk>``, ``<pad>``). A lone tokenizer.model is loaded as Llama's sentencepiece tokenizer
(converted to a fast tokenizer by transformers).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # imported where a tokenizer is loaded: transformers costs ~0.5 s of every worker's start
    import transformers

log = logging.getLogger("aligner.data")

# Role-tagged default template (one tag line per turn; assistant turns end with eos, so the
# loss on an assistant turn teaches the model to stop). Rendering messages[:i] with
# add_generation_prompt=True is always a prefix of rendering messages[:i+1] when message i
# is an assistant turn: aligner.data.encode relies on that to mask non-assistant tokens.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_SPECIAL_SPELLINGS = {
    "bos_token": ("<s>", "<bos>", "<|begin_of_text|>", "[BOS]"),
    "eos_token": ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[EOS]"),
    "unk_token": ("<unk>", "[UNK]"),
    "pad_token": ("<pad>", "[PAD]", "<|pad|>"),
}


def load_tokenizer(path: str, chat_template: str = "") -> transformers.PreTrainedTokenizerBase:
    """Load a tokenizer from local files and make its special tokens usable for training.

    path: an HF tokenizer dir (tokenizer.json / tokenizer.model + tokenizer_config.json), a
        tokenizer.json file (``tokenizers`` library format) or a sentencepiece tokenizer.model.
    chat_template: Jinja template overriding the tokenizer's own; "" keeps the tokenizer's,
        or installs :data:`DEFAULT_CHAT_TEMPLATE` when it has none.

    Returns a transformers tokenizer with ``eos_token`` set (ValueError if none can be found),
    ``pad_token`` = the tokenizer's pad, else eos, else unk, and ``bos_token`` where the
    vocabulary has one (may stay None: callers then add no bos).

    Raises FileNotFoundError for a missing path, ValueError for a file that is not a tokenizer
    (with the kinds accepted and how to fix it).
    """
    import transformers

    if not path:
        raise ValueError("tokenizer.path is empty: give an HF tokenizer dir, a tokenizer.json or a tokenizer.model")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"tokenizer.path={path!r} does not exist: give an HF tokenizer dir, a tokenizer.json or a sentencepiece tokenizer.model"
        )
    try:
        if os.path.isdir(path):
            tok = _load_dir(path)
        elif path.endswith(".json"):
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        elif path.endswith(".model"):
            tok = _load_sentencepiece(path)
        else:
            raise ValueError("unrecognized file name")
    except Exception as e:  # tokenizers raises bare Exception for malformed tokenizer.json
        raise ValueError(
            f"tokenizer.path={path!r} is not a loadable tokenizer ({type(e).__name__}: {e}): give an HF tokenizer dir, "
            "a tokenizer.json written by the `tokenizers` library, or a sentencepiece tokenizer.model"
        ) from e
    _fix_special_tokens(tok, path)
    if chat_template:
        tok.chat_template = chat_template
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def _load_dir(path: str) -> transformers.PreTrainedTokenizerBase:
    import transformers

    names = set(os.listdir(path))
    if "tokenizer_config.json" in names or "tokenizer.json" in names:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if "tokenizer.model" in names:
        return _load_sentencepiece(os.path.join(path, "tokenizer.model"))
    raise ValueError(f"no tokenizer.json, tokenizer_config.json or tokenizer.model in {sorted(names)[:10]}")


def _load_sentencepiece(model_file: str) -> transformers.PreTrainedTokenizerBase:
    """Llama's sentencepiece tokenizer from a tokenizer.model (converted to a fast tokenizer)."""
    import transformers

    with open(model_file, "rb") as f:
        head = f.read(64)
    if not head or head.lstrip()[:1] in (b"{", b"[", b"<"):
        raise ValueError("file does not look like a sentencepiece model protobuf")
    parent = os.path.dirname(os.path.abspath(model_file))
    if os.path.basename(model_file) == "tokenizer.model":
        return transformers.LlamaTokenizer.from_pretrained(parent, local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:  # from_pretrained wants the canonical file name
        shutil.copy(model_file, os.path.join(tmp, "tokenizer.model"))
        return transformers.LlamaTokenizer.from_pretrained(tmp, local_files_only=True)


def _find_special(tok: transformers.PreTrainedTokenizerBase, attr: str) -> Optional[str]:
    vocab = tok.get_vocab()
    for spelling in _SPECIAL_SPELLINGS[attr]:
        if spelling in vocab:
            return spelling
    return None


def _fix_special_tokens(tok: transformers.PreTrainedTokenizerBase, path: str) -> None:
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if getattr(tok, attr, None) is None:
            found = _find_special(tok, attr)
            if found is not None:
                setattr(tok, attr, found)
    if tok.eos_token is None:
        raise ValueError(
            f"tokenizer.path={path!r} has no eos token (looked for {', '.join(_SPECIAL_SPELLINGS['eos_token'])}): "
            "add one to the tokenizer (tokenizer_config.json eos_token)"
        )
    if tok.pad_token is None:  # padding is always masked by attention_mask, so eos is a safe pad id
        tok.pad_token = tok.eos_token
        log.info("tokenizer %s has no pad token: using eos %r", path, tok.pad_token)
