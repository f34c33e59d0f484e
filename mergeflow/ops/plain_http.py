"""A Prefect API on plain http:// needs no certificate store: its clients get a CA file of one certificate.

Every Prefect client builds an SSL context when it is created, loading PREFECT_API_SSL_CERT_FILE
(default: certifi's bundle of ~150 certificates) whether or not its API speaks TLS. A command
creates four (the flow run's, the log and event workers' and the event client's version check):
13-18 ms each on a fast 2-core machine, 30-40 ms on a loaded one, all of it before or around the
flow. For an http:// API no certificate is ever checked, so a file of one public root certificate
does: about 1 ms each.

Only the environment is changed, and only where the user set neither the CA file nor
PREFECT_API_TLS_INSECURE_SKIP_VERIFY: an https:// API, or any other TLS client (the Hub's
uploads), keeps its certificates.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

CA_FILE_VAR = "PREFECT_API_SSL_CERT_FILE"
ONE_CERTIFICATE = Path(__file__).with_name("plain_http_ca.pem")


def skip_certificate_store(api_url: str | None) -> bool:
    """Point Prefect's clients at the one-certificate CA file when `api_url` is plain http://; True if it did."""
    if not api_url or urlsplit(api_url).scheme.lower() != "http":
        return False
    if os.environ.get(CA_FILE_VAR) or os.environ.get("PREFECT_API_TLS_INSECURE_SKIP_VERIFY"):
        return False  # the user's choice stands
    os.environ[CA_FILE_VAR] = str(ONE_CERTIFICATE)
    return True
