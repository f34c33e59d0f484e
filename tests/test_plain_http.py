"""Prefect's clients of a plain http:// API load a CA file of one certificate, not certifi's bundle."""

from __future__ import annotations

import os
import ssl

import pytest

from mergeflow.ops.plain_http import (
    CA_FILE_VAR,
    ONE_CERTIFICATE,
    skip_certificate_store,
)


def test_the_one_certificate_file_is_a_ca_file_ssl_loads() -> None:
    # Shipped as package data: Prefect hands it to ssl.create_default_context(cafile=...), which must not fail.
    assert ssl.create_default_context(cafile=str(ONE_CERTIFICATE)).cert_store_stats()["x509_ca"] == 1


@pytest.mark.parametrize("url", ["http://127.0.0.1:4200/api", "HTTP://prefect.internal/api"])
def test_an_http_api_gets_the_one_certificate_file(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.delenv(CA_FILE_VAR, raising=False)
    monkeypatch.delenv("PREFECT_API_TLS_INSECURE_SKIP_VERIFY", raising=False)
    assert skip_certificate_store(url)
    assert os.environ[CA_FILE_VAR] == str(ONE_CERTIFICATE)


@pytest.mark.parametrize("url", ["https://api.prefect.cloud/api/accounts/a/workspaces/w", "https://10.0.0.5/api", "", None])
def test_an_https_or_unknown_api_keeps_its_certificates(monkeypatch: pytest.MonkeyPatch, url: str | None) -> None:
    monkeypatch.delenv(CA_FILE_VAR, raising=False)
    assert not skip_certificate_store(url)
    assert CA_FILE_VAR not in os.environ


@pytest.mark.parametrize("var", [CA_FILE_VAR, "PREFECT_API_TLS_INSECURE_SKIP_VERIFY"])
def test_the_users_own_tls_setting_stands(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.delenv(CA_FILE_VAR, raising=False)
    monkeypatch.setenv(var, "/etc/ssl/certs/ca-certificates.crt" if var == CA_FILE_VAR else "true")
    assert not skip_certificate_store("http://127.0.0.1:4200/api")
    assert os.environ.get(CA_FILE_VAR) == ("/etc/ssl/certs/ca-certificates.crt" if var == CA_FILE_VAR else None)
