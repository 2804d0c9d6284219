"""Flags read PAGEMESH_* variables when they are parsed, never at import."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import redis

from pagemesh.runtime.config import add_flag, with_password
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.embedded_valkey import EmbeddedValkey


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flag(p, "--max-tokens", type=int, default=7)
    add_flag(p, "--chat", type=bool, default=False)
    add_flag(p, "--stop", action="append", default=None)
    return p


def test_variables_give_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    assert vars(parser().parse_args([])) == {"max_tokens": 7, "chat": False, "stop": None}
    monkeypatch.setenv("PAGEMESH_MAX_TOKENS", "12")
    monkeypatch.setenv("PAGEMESH_CHAT", "yes")
    monkeypatch.setenv("PAGEMESH_STOP", "###")
    assert vars(parser().parse_args([])) == {"max_tokens": 12, "chat": True, "stop": ["###"]}
    args = parser().parse_args(["--max-tokens", "3", "--no-chat", "--stop", "a", "--stop", "b"])
    assert (args.max_tokens, args.chat, args.stop) == (3, False, ["a", "b"])  # replaced, not added


def test_a_file_variable_gives_a_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PAGEMESH_X_FILE names a file holding the value (a compose or Kubernetes secret); its
    trailing newline is not part of it, and PAGEMESH_X itself wins."""
    (tmp_path / "stop").write_text("from-a-file\n")
    monkeypatch.setenv("PAGEMESH_STOP_FILE", str(tmp_path / "stop"))
    assert parser().parse_args([]).stop == ["from-a-file"]
    monkeypatch.setenv("PAGEMESH_STOP", "from-the-variable")
    assert parser().parse_args([]).stop == ["from-the-variable"]
    monkeypatch.delenv("PAGEMESH_STOP")
    monkeypatch.setenv("PAGEMESH_STOP_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="PAGEMESH_STOP_FILE=.*missing: cannot read it"):
        parser().parse_args([])


def test_a_password_joins_the_url_of_a_locked_valkey() -> None:
    assert with_password("redis://h:1/0", None) == "redis://h:1/0"
    assert (
        with_password("rediss://pagemesh@h:6380/2?ssl_ca_certs=/ca.pem", "p@ss:/w")
        == "rediss://pagemesh:p%40ss%3A%2Fw@h:6380/2?ssl_ca_certs=/ca.pem"
    )
    assert with_password("redis://u:old@[::1]:6379/0", "new") == "redis://u:new@[::1]:6379/0"
    valkey = EmbeddedValkey(reserve_port()).start()
    try:
        bare = f"redis://pagemesh@127.0.0.1:{valkey.port}/0"
        with redis.Redis.from_url(bare) as client, pytest.raises(redis.AuthenticationError):
            client.set("k", "v")
        with redis.Redis.from_url(with_password(bare, valkey.password)) as client:
            assert client.set("k", "v")
    finally:
        valkey.stop()
