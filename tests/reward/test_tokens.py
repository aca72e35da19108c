"""The remote reward's shared token never comes from the command line (other users of the machine
read a process's arguments in /proc/PID/cmdline, and W&B records them): the run's config and
``python -m aligner.serve_rm`` refuse it there in one line naming the environment variable and the
token file; both read it from ALIGNER_RM_TOKEN or a file."""

from __future__ import annotations

import pytest

from aligner import serve_rm
from aligner.cli import load_config
from aligner.config import ConfigError
from tests.toolkit.overrides import PPO_RULE


@pytest.mark.parametrize("override", ["reward.token=hunter2", "+reward.token=hunter2", "++reward.token=hunter2"])
def test_a_token_on_the_command_line_is_refused(override):
    with pytest.raises(ConfigError) as e:
        load_config("ppo", [*PPO_RULE, override])
    msg = str(e.value)
    assert "\n" not in msg and "not accepted on the command line" in msg and "ALIGNER_RM_TOKEN" in msg and "reward.token_file" in msg
    assert "hunter2" not in msg


def test_the_command_line_runs_without_the_token(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNER_RM_TOKEN", "from-env")
    cfg = load_config("ppo", [*PPO_RULE, "reward.type=remote", "reward.url=http://127.0.0.1:5000/score"])
    from aligner.workers.reward import remote_reward_client

    client = remote_reward_client(cfg.reward)
    try:
        assert client.token == "from-env"
    finally:
        client.close()
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    cfg = load_config("ppo", [*PPO_RULE, "reward.type=remote", "reward.url=http://127.0.0.1:5000/score", f"reward.token_file={f}"])
    client = remote_reward_client(cfg.reward)
    try:
        assert client.token == "from-file"
    finally:
        client.close()


def test_serve_rm_refuses_a_token_argument_and_reads_the_environment_or_a_file(monkeypatch, tmp_path, capsys):
    with pytest.raises(serve_rm.UsageError, match="not accepted on the command line.*ALIGNER_RM_TOKEN.*token_file"):
        serve_rm.parse_args(["reward.type=rule", "token=hunter2"])
    assert serve_rm.main(["reward.type=rule", "token=hunter2"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and err.count("\n") == 1
    monkeypatch.setenv("ALIGNER_RM_TOKEN", "from-env")
    assert serve_rm.parse_args(["reward.type=rule"])["token"] == "from-env"
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    assert serve_rm.parse_args(["reward.type=rule", f"token_file={f}"])["token"] == "from-file"
    with pytest.raises(serve_rm.UsageError, match="token_file"):
        serve_rm.parse_args(["reward.type=rule", f"token_file={tmp_path / 'missing'}"])


def test_serve_rm_refuses_a_bind_off_loopback_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv("ALIGNER_RM_TOKEN", raising=False)
    assert serve_rm.main(["reward.type=rule", "host=0.0.0.0", "port=0"]) == 2
    assert "no token is set" in capsys.readouterr().err
    settings = serve_rm.parse_args(["reward.type=rule", "host=0.0.0.0", "port=0", "allow_no_token=1"])
    serve_rm.build_server(settings).server_close()
