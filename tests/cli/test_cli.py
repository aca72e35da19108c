"""Bad inputs of every kind get a clear error naming what and where, and leave no partial output.

Tables: data files (every format: invalid JSON, missing field, wrong type, empty text,
non-UTF-8, a row that is not an object, over-long prompt), configs, tokenizers and
checkpoints (HF dirs and aligner dcp checkpoints). Each case asserts the exception type and
the words of its message (file name and line or field), and that the output directory holds
no half-written file afterwards. A few cases go through ``python -m aligner.ppo`` to check
the command-line contract (exit 2, one line, no traceback); the rest call library functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aligner.config import ConfigError, DataConfig, OptimConfig, ParallelConfig, TaskConfig
from tests.toolkit.models import tiny_model_config

SMALL_WIDTH = dict(hidden_size=16, intermediate_size=32, num_heads=2)  # of tiny_model_config
HH = "\n\nHuman: hi\n\nAssistant: "


def assert_no_partial_output(root: Path) -> None:
    """No temp/half-written entries anywhere under `root` (names with .tmp / .old, empty weight files)."""
    if not root.exists():
        return
    for p in root.rglob("*"):
        assert ".tmp" not in p.name and ".old" not in p.name, f"partial output left: {p}"
        if p.suffix == ".safetensors":
            assert p.stat().st_size > 0, p


def _write(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for x in lines:
            f.write((x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode()) + b"\n")
    return path


# ---- data files ------------------------------------------------------------------------
# (id, format, kind, rows, line of the error, words of the message)
DATA_CASES = [
    (
        "prompt_invalid_json",
        "prompt",
        "prompt",
        [{"prompt": "1+1="}, '{"prompt": "2+2=",'],
        2,
        ["invalid JSON", "one JSON object per line"],
    ),
    ("prompt_missing_field", "prompt", "prompt", [{"question": "1+1="}], 1, ["field 'prompt' is missing"]),
    ("prompt_not_object", "prompt", "prompt", [{"prompt": "a"}, ["a", "b"]], 2, ["row must be a JSON object", "list"]),
    (
        "prompt_non_utf8",
        "prompt",
        "prompt",
        [{"prompt": "a"}, {"prompt": "b"}, b'{"prompt": "\xff\xfe"}'],
        3,
        ["not valid UTF-8", "re-encode"],
    ),
    ("sft_wrong_type", "sft", "sft", [{"prompt": "1+1=", "response": 2}], 1, ["field 'response' must be a string", "int"]),
    (
        "sft_empty_text",
        "sft",
        "sft",
        [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+2=", "response": "   "}],
        2,
        ["field 'response' is empty"],
    ),
    ("sft_missing_response", "sft", "sft", [{"prompt": "1+1=", "answer": "2"}], 1, ["field 'response' is missing"]),
    ("chat_bad_role", "chat", "sft", [{"messages": [{"role": "bot", "content": "x"}]}], 1, ["messages[0].role", "system, user, assistant"]),
    ("chat_missing_content", "chat", "sft", [{"messages": [{"role": "user"}]}], 1, ["messages[0]", "field 'content' is missing"]),
    ("chat_not_list", "chat", "sft", [{"messages": "hello"}], 1, ["field 'messages' must be a non-empty list"]),
    ("chat_no_assistant_for_sft", "chat", "sft", [{"messages": [{"role": "user", "content": "hi"}]}], 1, ["no response", "assistant"]),
    ("pairs_missing_rejected", "pairs", "pairs", [{"prompt": "p", "chosen": "a"}], 1, ["field 'rejected' is missing"]),
    (
        "pairs_wrong_type",
        "pairs",
        "pairs",
        [{"prompt": "p", "chosen": ["a"], "rejected": "b"}],
        1,
        ["field 'chosen' must be a string", "list"],
    ),
    ("hh_not_dialogue", "hh", "pairs", [{"chosen": "just text", "rejected": "other"}], 1, ["field 'chosen'", "not an Anthropic HH row"]),
    ("hh_prompts_differ", "hh", "pairs", [{"chosen": HH + "a", "rejected": "\n\nHuman: yo\n\nAssistant: b"}], 1, ["do not share"]),
    ("hh_empty_answer", "hh", "pairs", [{"chosen": HH + "ok", "rejected": HH + "  "}], 1, ["'rejected'", "empty final assistant turn"]),
    ("gsm8k_no_final_answer", "gsm8k", "sft", [{"question": "q", "answer": "it is 4"}], 1, ["field 'answer'", "####"]),
    ("gsm8k_empty_question", "gsm8k", "prompt", [{"question": "", "answer": "#### 4"}], 1, ["field 'question' is empty"]),
    ("auto_no_format", "auto", "prompt", [{"body": "x"}], 1, ["matches no format", "data.format"]),
    ("prompt_file_for_sft", "auto", "sft", [{"prompt": "x"}], None, ["format 'prompt' cannot supply sft", "sft, chat, pairs, hh, gsm8k"]),
]


@pytest.mark.parametrize("case", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_file(tmp_path, case):
    from aligner.data.formats import load_records

    name, fmt, kind, rows, line, words = case
    path = _write(tmp_path / f"{name}.jsonl", rows)
    with pytest.raises(ValueError) as e:
        load_records(str(path), fmt, kind)
    msg = str(e.value)
    where = f"{path}:{line}" if line else str(path)
    assert where in msg, f"expected {where} in: {msg}"
    for w in words:
        assert w in msg, f"expected {w!r} in: {msg}"
    assert sorted(os.listdir(tmp_path)) == [path.name], "loading must write nothing"


def test_skip_invalid_counts_and_names_the_rows(tmp_path):
    from aligner.data.formats import load_records

    path = _write(tmp_path / "mixed.jsonl", [{"prompt": "a"}, "{oops", {"prompt": 3}, {"prompt": "b"}])
    res = load_records(str(path), "prompt", "prompt", skip_invalid=True)
    assert [r["prompt"] for r in res.records] == ["a", "b"] and res.num_skipped == 2
    assert f"{path}:2" in res.reasons[0] and f"{path}:3" in res.reasons[1]


@pytest.fixture(scope="module")
def task_tokenizer(tmp_path_factory):
    from aligner.data.task import build_task_tokenizer

    return build_task_tokenizer(TaskConfig(tokenizer_vocab_size=64), str(tmp_path_factory.mktemp("tok")))


def test_over_long_prompt_names_row_and_fix(tmp_path, task_tokenizer):
    from aligner.data.pipeline import load_data
    from aligner.data.tokenizer import load_tokenizer

    path = _write(tmp_path / "long.jsonl", [{"prompt": "1+1=", "response": "2"}, {"prompt": "12+34=" * 20, "response": "46"}])
    work = tmp_path / "work"
    cfg = DataConfig(train_path=str(path), format="sft", max_prompt_len=16, max_seq_len=32, eval_fraction=0.0)
    with pytest.raises(ValueError) as e:
        load_data("sft", cfg, TaskConfig(), load_tokenizer(task_tokenizer), str(work))
    msg = str(e.value)
    assert f"{path}:2: prompt has" in msg and "data.max_prompt_len=16" in msg and "data.truncation=left|right|skip" in msg, msg
    assert not work.exists(), "a failed load must not create the work dir when data.train_path is given"


# ---- tokenizers ------------------------------------------------------------------------
def test_tokenizer_missing_path(tmp_path):
    from aligner.data.tokenizer import load_tokenizer

    with pytest.raises(FileNotFoundError, match=r"tokenizer.path='.*nope' does not exist: give an HF tokenizer dir"):
        load_tokenizer(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    "name,content", [("tokenizer.json", '{"not": "a tokenizer"}'), ("tokenizer.model", "{json pretending}"), ("weights.bin", "binary")]
)
def test_not_a_tokenizer(tmp_path, name, content):
    from aligner.data.tokenizer import load_tokenizer

    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(tmp_path / name))
    assert f"tokenizer.path={str(tmp_path / name)!r} is not a loadable tokenizer" in str(e.value), str(e.value)
    assert sorted(os.listdir(tmp_path)) == [name]


def test_tokenizer_dir_without_files(tmp_path):
    from aligner.data.tokenizer import load_tokenizer

    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no tokenizer.json, tokenizer_config.json or tokenizer.model"):
        load_tokenizer(str(tmp_path))


# ---- checkpoints -------------------------------------------------------------------------
@pytest.fixture
def hf_dir(tmp_path):
    from aligner.model.hf import save_hf
    from aligner.model.llama import build_model

    cfg = tiny_model_config(**SMALL_WIDTH)
    return save_hf(build_model(cfg, "lm", seed=0).state_dict(), cfg, tmp_path / "hf", max_shard_bytes=2**30)


def _sharded(d: Path) -> Path:
    from aligner.model.hf import save_hf
    from aligner.model.llama import build_model

    cfg = tiny_model_config(**SMALL_WIDTH)
    return save_hf(build_model(cfg, "lm", seed=0).state_dict(), cfg, d, max_shard_bytes=8192)


def _corrupt(kind: str, d: Path) -> tuple[Path, list[str]]:
    """Break HF dir `d` in one way; return (dir to load, words the error must contain)."""
    st = d / "model.safetensors"
    if kind == "missing_config":
        (d / "config.json").unlink()
        return d, [f"{d / 'config.json'}: missing"]
    if kind == "config_not_json":
        (d / "config.json").write_text("{vocab_size: 64")
        return d, [f"{d / 'config.json'}: not valid JSON"]
    if kind == "config_missing_field":
        c = json.loads((d / "config.json").read_text())
        del c["hidden_size"]
        (d / "config.json").write_text(json.dumps(c))
        return d, ["config.json: required field 'hidden_size' is missing"]
    if kind == "missing_weights":
        st.unlink()
        return d, [f"{d}: no model.safetensors"]
    if kind == "truncated_safetensors":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
        return d, [f"{st}: cannot read safetensors", "truncated or corrupted"]
    if kind == "corrupted_header":
        data = bytearray(st.read_bytes())
        data[8:40] = b"\x00" * 32
        st.write_bytes(bytes(data))
        return d, [f"{st}: cannot read safetensors"]
    if kind == "wrong_shape":
        from safetensors.torch import load_file, save_file

        sd = load_file(str(st))
        sd["model.norm.weight"] = torch.ones(SMALL_WIDTH["hidden_size"] + 1)
        save_file(sd, str(st))
        return d, ["tensor model.norm.weight has shape (17,) but the model expects (16,)"]
    if kind == "other_model_size":
        c = json.loads((d / "config.json").read_text())
        c["num_hidden_layers"] = 3
        (d / "config.json").write_text(json.dumps(c))
        return d, ["weights do not match the model", "missing ['model.layers.2."]
    if kind == "bad_index_json":
        s = _sharded(d.parent / "sharded")
        (s / "model.safetensors.index.json").write_text('{"weight_map": ')
        return s, [f"{s / 'model.safetensors.index.json'}: not a valid safetensors index"]
    if kind == "index_missing_shard":
        s = _sharded(d.parent / "sharded")
        shard = sorted(s.glob("model-*.safetensors"))[0]
        shard.unlink()
        return s, [f"{shard}: listed in model.safetensors.index.json but missing"]
    if kind == "not_a_dir":
        return d / "config.json", ["not a directory"]
    raise AssertionError(kind)


CKPT_CASES = [
    "missing_config",
    "config_not_json",
    "config_missing_field",
    "missing_weights",
    "truncated_safetensors",
    "corrupted_header",
    "wrong_shape",
    "other_model_size",
    "bad_index_json",
    "index_missing_shard",
]


@pytest.mark.parametrize("kind", CKPT_CASES)
def test_bad_hf_checkpoint(hf_dir, kind):
    from aligner.model.hf import CheckpointError, load_hf_model

    target, words = _corrupt(kind, hf_dir)
    with pytest.raises(CheckpointError) as e:
        load_hf_model(target)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"expected {w!r} in: {msg}"
    assert_no_partial_output(hf_dir.parent)


def test_bad_hf_checkpoint_as_role_init(hf_dir):
    """The same errors reach a role's init (RoleModel resolves and loads the dir)."""
    from aligner.model.hf import CheckpointError
    from aligner.runtime.role import load_initial_model, resolve_init

    _corrupt("truncated_safetensors", hf_dir)
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors"):
        load_initial_model(str(hf_dir.parent), tiny_model_config(**SMALL_WIDTH), "lm", seed=0)  # run dir with hf/ inside
    with pytest.raises(ValueError, match=r"init='.*empty' is neither an HF model dir .* nor an aligner run dir"):
        (hf_dir.parent / "empty").mkdir()
        resolve_init(str(hf_dir.parent / "empty"))


def test_save_hf_refuses_nan_and_leaves_nothing(tmp_path):
    from aligner.model.hf import CheckpointError, save_hf
    from aligner.model.llama import build_model

    cfg = tiny_model_config(**SMALL_WIDTH)
    sd = build_model(cfg, "lm", seed=0).state_dict()
    sd["model.norm.weight"][3] = float("nan")
    with pytest.raises(CheckpointError, match="tensor model.norm.weight has NaN/Inf"):
        save_hf(sd, cfg, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def _engine(**model_kw):
    from aligner.parallel.dims import ParallelDims
    from aligner.runtime.train_runtime import TrainRuntime

    return TrainRuntime(
        tiny_model_config(**{**SMALL_WIDTH, **model_kw}), "lm", ParallelConfig(), OptimConfig(), ParallelDims(), total_steps=10
    )


@pytest.mark.parametrize(
    "kind,words",
    [
        ("other_size", ["has model.hidden_size=16 but this model has 32", "same model config"]),
        ("no_meta", ["has no meta.json", "not a complete aligner checkpoint"]),
        ("missing_dir", ["has no meta.json"]),
    ],
)
def test_bad_aligner_checkpoint(tmp_path, kind, words):
    eng = _engine()
    ckpt = tmp_path / "ckpt"
    eng.save(str(ckpt))
    if kind == "no_meta":
        (ckpt / "meta.json").unlink()
    if kind == "missing_dir":
        ckpt = tmp_path / "nope"
    other = _engine(hidden_size=32) if kind == "other_size" else _engine()
    with pytest.raises(ValueError) as e:
        other.load(str(ckpt))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert_no_partial_output(tmp_path)


# ---- configs (library) -----------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,words",
    [
        (
            ["conf=llama5"],
            ["conf='llama5' is not a preset", "tiny, tiny_tools, smollm2_135m, smollm2_ifeval, llama2_7b, llama2_13b, llama2_70b"],
        ),
        (["actor.parallel.tp_size=3"], ["actor.parallel.tp_size=3", "must divide model.num_heads=4"]),
        (["actor.optim.lr=-0.001"], ["actor.optim.lr=-0.001", "must be positive"]),
        (["algorithm.advantage=dpo"], ["algorithm.advantage='dpo'", "gae, grpo, rloo, reinforce_pp"]),
        (["rollout.backend=sglang"], ["rollout.backend='sglang'", "valid choices are torch, trtllm, vllm"]),
        (["model.backend=jax"], ["model.backend='jax'", "torch, te"]),
    ],
)
def test_bad_config(overrides, words):
    from aligner.cli import load_config

    with pytest.raises(ConfigError) as e:
        load_config("ppo", overrides)
    for w in words:
        assert w in str(e.value)


# ---- through the command line (each ~5-10 s) ---------------------------------------------
def _ppo(tmp_path: Path, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    base = [
        "reward.type=rule",
        "reward.rule=digit_fraction",
        "actor.init=",
        "reward.init=",
        "critic.init=",
        "task.num_sft=50",
        "task.num_pairs=50",
        "task.num_rl=50",
        "task.num_eval=8",
        f"output_dir={tmp_path / 'out'}",
    ]
    return subprocess.run([sys.executable, "-m", "aligner.ppo", *base, *args], capture_output=True, text=True, timeout=timeout)


def _one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("aligner ppo: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_cli_missing_data_file(tmp_path):
    line = _one_line_exit_2(_ppo(tmp_path, f"data.train_path={tmp_path}/missing.jsonl"))
    assert f"data.train_path='{tmp_path}/missing.jsonl' does not exist" in line
    assert not (tmp_path / "out").exists()


def test_cli_invalid_data_row(tmp_path):
    path = _write(tmp_path / "rl.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}, '{"prompt": '])
    line = _one_line_exit_2(_ppo(tmp_path, f"data.train_path={path}", "data.format=prompt"))
    assert f"{path}:3: invalid JSON" in line, line
    out = tmp_path / "out"
    assert not (out / "checkpoints").exists() and not (out / "hf").exists()
    assert_no_partial_output(out)


def test_cli_not_a_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("[1, 2, 3]")
    line = _one_line_exit_2(_ppo(tmp_path, f"tokenizer.path={tmp_path / 'tokenizer.json'}"))
    assert "is not a loadable tokenizer" in line and "tokenizer.json" in line, line
    assert_no_partial_output(tmp_path / "out")


@pytest.mark.slow
def test_cli_tokenizer_larger_than_model_vocab(tmp_path):
    proc = _ppo(
        tmp_path,
        "model.vocab_size=16",
        "task.tokenizer_vocab_size=64",
        "trainer.max_steps=1",
        "trainer.rollout_batch_size=8",
        "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=8",
        timeout=120,
    )
    line = _one_line_exit_2(proc)
    assert "model.vocab_size=16 is smaller than the tokenizer's" in line, line


def test_a_cluster_too_small_for_the_groups_is_an_error_line_not_a_traceback(capsys):
    """A joined cluster (or one that lost a node and was not replaced within trainer.restart_wait_s) that cannot
    hold the worker groups: the PlacementError's message (what was asked, what exists, the fix) after one
    "aligner <stage>: error:" line, exit 2, no traceback."""
    from aligner.cli import run
    from aligner.errors import PlacementError

    def main(cfg):
        raise PlacementError("the cluster cannot hold the requested placement (2 CPU in total, the cluster has 0).\nasked: ...")

    assert run("sft", main, ["conf=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aligner sft: error: the cluster cannot hold the requested placement (2 CPU in total") and "Traceback" not in err


def test_a_sigterm_taken_by_rays_handler_is_the_preemption_exit(capsys):
    """Ray's driver handler turns a SIGTERM outside aligner's own handler into sys.exit(15); the entry point
    reports it as a preemption (143, one line saying the last checkpoint is intact), other exits pass through."""
    from aligner.cli import run

    def raises(code):
        def main(cfg):
            raise SystemExit(code)

        return main

    assert run("sft", raises(15), ["conf=tiny"]) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("aligner sft: stopped by SIGTERM") and "resume=true" in line
    with pytest.raises(SystemExit) as info:
        run("sft", raises(3), ["conf=tiny"])
    assert info.value.code == 3


@pytest.mark.parametrize(
    "flag",
    [["--cfg"], ["--cfg", "job"], ["--cfg=job"], ["-c", "job"], ["--cfg", "all"]],
    ids=["--cfg", "--cfg job", "--cfg=job", "-c job", "--cfg all"],
)
def test_cfg_takes_hydras_forms_and_prints_the_composed_config(flag, capsys):
    """Hydra's `--cfg job` (and its short and `=` forms) print the composed config as plain `--cfg` does;
    an override after the flag still applies."""
    from aligner.cli import run

    assert run("ppo", lambda cfg: 1, [*flag, "trainer.max_steps=7"]) == 0
    printed = capsys.readouterr().out
    assert "  max_steps: 7\n" in printed, printed[-2000:]


def test_cfg_hydra_is_refused_in_one_line(capsys):
    from aligner.cli import run

    assert run("ppo", lambda cfg: 1, ["--cfg", "hydra"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "aligner ppo: error: --cfg hydra is invalid: aligner prints its job config only; use --cfg or --cfg job", err


def test_demo_help_prints_its_usage_and_runs_no_stage(tmp_path, capsys):
    """`python -m aligner.demo --help` prints the demo's usage and exits 0, without starting Ray or a stage
    (it used to hand --help to each stage and then fail reading a summary no stage wrote)."""
    from aligner import demo

    assert demo.main(["--help", f"output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m aligner.demo")
    assert not any(tmp_path.iterdir())
