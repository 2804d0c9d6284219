"""Flags read PAGEMESH_* variables when they are parsed, never at import."""

from __future__ import annotations

import argparse

import pytest

from pagemesh.config import add_flag


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
