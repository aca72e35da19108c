"""Tokenizer loading: Llama 2 sentencepiece, tokenizer.json, HF dirs, special tokens, chat template, errors."""

from __future__ import annotations

import pytest

from aligner.config import TaskConfig
from aligner.data.task import build_task_tokenizer
from aligner.data.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer
from tests.toolkit.paths import shared_path


@pytest.fixture(scope="module")
def llama2():
    return load_tokenizer(str(shared_path("data", "tokenizers", "llama2", "tokenizer.model")))


def test_llama2_from_sentencepiece_model(llama2):
    tok = llama2
    assert len(tok) == 32000
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert tok.pad_token_id == tok.eos_token_id  # Llama 2 has no pad token
    # Known Llama 2 ids: "▁Hello" = 15043, digits are split individually ("1" = 29896).
    assert tok.encode("Hello", add_special_tokens=False) == [15043]
    assert tok.convert_tokens_to_ids("1") == 29896
    for text in [
        "Hello world, 12+39=51",
        "Ünïcödé — 你好\nnew line",
        "two  spaces  inside",
    ]:  # a leading space is dropped on decode, as in Llama 2
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE


def test_sentencepiece_dir_and_renamed_file(tmp_path):
    src = shared_path("data", "tokenizers", "llama2", "tokenizer.model")
    other = tmp_path / "llama.model"
    other.write_bytes(src.read_bytes())
    tok = load_tokenizer(str(other))
    assert tok.encode("Hello", add_special_tokens=False) == [15043]


def test_tokenizer_json_and_saved_dir(tmp_path):
    path = build_task_tokenizer(TaskConfig(tokenizer_vocab_size=64), str(tmp_path / "t"))
    tok = load_tokenizer(path, chat_template="{{ messages[0]['content'] }}")
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    tok.save_pretrained(str(tmp_path / "hf"))
    again = load_tokenizer(str(tmp_path / "hf"))
    assert again.encode("12+39=51") == tok.encode("12+39=51")
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)


def test_default_chat_template_renders_roles(tmp_path):
    tok = load_tokenizer(build_task_tokenizer(TaskConfig(tokenizer_vocab_size=128), str(tmp_path)))
    msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<bos><|user|>\n1+2=\n<|assistant|>\n3<eos>"
    gen = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(gen) and gen.endswith("<|assistant|>\n")


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="not a loadable tokenizer"):
        load_tokenizer(str(bad))
    junk = tmp_path / "x.model"
    junk.write_text("hello")
    with pytest.raises(ValueError, match="not a loadable tokenizer"):
        load_tokenizer(str(junk))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    txt = tmp_path / "vocab.txt"
    txt.write_text("a")
    with pytest.raises(ValueError, match="not a loadable tokenizer"):
        load_tokenizer(str(txt))
    with pytest.raises(ValueError, match="tokenizer.path is empty"):
        load_tokenizer("")
