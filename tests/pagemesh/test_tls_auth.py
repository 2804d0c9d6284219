"""TlsConfig validation, API-key parsing and checking: no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagemesh.runtime.auth import ADMIN, INFERENCE, ApiKeys, parse_api_keys_file
from pagemesh.runtime.config import add_tls_flags, tls_config
from pagemesh.runtime.tls import TlsConfig
from router.generation import AdmissionLimits
from router.main import parse_args


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    path = tmp_path / "x.pem"
    path.write_text("not checked until used")
    return path


def test_tls_off_by_default() -> None:
    tls = TlsConfig()
    assert not tls.serves_tls and not tls.dials_tls
    assert tls.server_credentials() is None and tls.channel_credentials() is None
    assert tls.flags() == []


def test_key_without_cert_is_an_error(pem: Path) -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TlsConfig(key_path=str(pem))
    with pytest.raises(ValueError, match="go together"):
        TlsConfig(cert_path=str(pem))


def test_missing_files_are_errors(pem: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-ca .*no such file"):
        TlsConfig(ca_path=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--tls-key .*no such file"):
        TlsConfig(cert_path=str(pem), key_path=str(tmp_path / "missing.key"))


def test_modes_and_flags(pem: Path) -> None:
    tls = TlsConfig(str(pem), str(pem), str(pem))
    assert tls.serves_tls and tls.dials_tls and tls.requires_client_cert
    assert tls.flags() == ["--tls-cert", str(pem), "--tls-key", str(pem), "--tls-ca", str(pem)]
    server_only = TlsConfig(str(pem), str(pem))
    assert (
        server_only.serves_tls
        and not server_only.requires_client_cert
        and not server_only.dials_tls
    )
    assert TlsConfig(ca_path=str(pem)).dials_tls


def test_tls_flags_read_environment(pem: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("PAGEMESH_TLS_CA", str(pem))
    parser = argparse.ArgumentParser()
    add_tls_flags(parser)
    assert tls_config(parser.parse_args([])) == TlsConfig(ca_path=str(pem))


def test_api_keys_file_parsing() -> None:
    text = (
        "# keys of team a\nkey-1\n\n  key-2   # rotated 2024\n#key-3\nops-1 admin\n"
        "key-4 inference\n"
    )
    assert parse_api_keys_file(text) == [
        ("key-1", INFERENCE),
        ("key-2", INFERENCE),
        ("ops-1", ADMIN),
        ("key-4", INFERENCE),
    ]
    for bad in ("key-1 root\n", "key-1 admin extra\n"):
        with pytest.raises(ValueError, match="line 1") as info:
            parse_api_keys_file(bad)
        assert "key-1" not in str(info.value)  # a key is never in a message


def test_scopes_inference_keys_are_not_admins(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("ops admin\n")
    keys = ApiKeys.load(
        ["a b"], str(path), ["root"]
    )  # "a b": two keys, as PAGEMESH_API_KEY gives them
    assert [keys.scope_of(f"Bearer {k}") for k in ("a", "b", "ops", "root", "nope")] == [
        INFERENCE,
        INFERENCE,
        ADMIN,
        ADMIN,
        None,
    ]
    assert keys.check_authorization("Bearer a") and not keys.check_authorization("Bearer a", ADMIN)
    assert keys.check_authorization("Bearer ops") and keys.check_authorization("Bearer ops", ADMIN)
    assert ApiKeys([]).check_authorization(None, ADMIN)  # keys off: everything open


def test_api_keys_load_merges_flags_and_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("from-file\n")
    keys = ApiKeys.load(["from-flag", "from-file"], str(path))
    assert len(keys) == 2
    assert keys.check_authorization("Bearer from-flag")
    assert keys.check_authorization("bearer from-file")


def test_api_key_check() -> None:
    keys = ApiKeys(["secret"])
    assert keys.enabled
    assert keys.check_authorization("Bearer secret")
    for bad in (None, "", "secret", "Bearer", "Bearer secre", "Bearer secret2", "Basic secret"):
        assert not keys.check_authorization(bad), bad
    assert ApiKeys([]).check_authorization(None)  # no keys: open


def test_api_keys_reject_blank_or_spaced() -> None:
    with pytest.raises(ValueError):
        ApiKeys(["has space"])
    with pytest.raises(ValueError):
        ApiKeys([""])


def test_router_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEMESH_API_KEY", "env-key")
    args = parse_args(["--model", "m"])
    assert args.api_key == ["env-key"]
    assert (args.max_queued_requests, args.max_prompt_tokens, args.max_message_bytes) == (
        1024,
        0,
        16 * 1024 * 1024,
    )
    args = parse_args(["--model", "m", "--api-key", "a", "--api-key", "b"])
    assert args.api_key[-2:] == ["a", "b"]


def test_admission_limits_validation() -> None:
    with pytest.raises(ValueError):
        AdmissionLimits(max_queued_requests=0)
    with pytest.raises(ValueError):
        AdmissionLimits(max_prompt_tokens=-1)
