"""`moe-pipe up`'s choices before anything starts: an API exposed with no key is refused,
the key comes from --api-key or MOE_PIPE_API_KEY and never reaches a command line."""

from __future__ import annotations

import pytest

from moe_pipe.cli import up_cmd
from moe_pipe.cli.main import main


@pytest.fixture
def served(monkeypatch):
    """The config `up` would serve, captured instead of served."""
    got = {}

    def fake_serve(cfg, name, detached):
        got["cfg"] = cfg
        return 0

    monkeypatch.setattr(up_cmd, "_serve", fake_serve)
    monkeypatch.delenv(up_cmd.API_KEY_ENV, raising=False)
    return got


def test_a_network_host_without_a_key_is_refused_in_one_line(served, capsys):
    assert main(["up", "--host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err == (
        "moe-pipe: error: --host 0.0.0.0 exposes the API to the network with no key: set one with MOE_PIPE_API_KEY=KEY "
        "(kept out of the process list) or --api-key KEY, or pass --no-api-key to serve it openly\n"
    )
    assert "cfg" not in served


def test_no_api_key_serves_openly_with_a_warning(served, capsys):
    assert main(["up", "--host", "0.0.0.0", "--no-api-key"]) == 0
    assert served["cfg"].gateway.api_key is None
    assert "warning: serving the API on 0.0.0.0 with no key" in capsys.readouterr().err


def test_the_key_comes_from_the_flag_or_the_environment(served, monkeypatch, capsys):
    assert main(["up", "--host", "0.0.0.0", "--api-key", "k1"]) == 0
    assert served["cfg"].gateway.api_key == "k1"
    monkeypatch.setenv(up_cmd.API_KEY_ENV, "k2")
    assert main(["up", "--host", "0.0.0.0"]) == 0
    assert served["cfg"].gateway.api_key == "k2"
    assert main(["up", "--host", "0.0.0.0", "--api-key", "k1"]) == 0  # the flag wins
    assert served["cfg"].gateway.api_key == "k1"
    assert main(["up"]) == 0 and served["cfg"].gateway.host == "127.0.0.1"  # loopback: no key needed
    assert "k1" not in capsys.readouterr().err


def test_a_detached_child_gets_the_key_in_its_environment_not_its_argv():
    argv, env = up_cmd._child_argv(["up", "m.gguf", "--detach", "--api-key", "s3cret", "--port", "0"])
    assert argv == ["up", "m.gguf", "--port", "0", up_cmd.DETACHED_FLAG] and env[up_cmd.API_KEY_ENV] == "s3cret"
    argv, env = up_cmd._child_argv(["up", "--api-key=s3cret"])
    assert argv == ["up", up_cmd.DETACHED_FLAG] and env[up_cmd.API_KEY_ENV] == "s3cret"
