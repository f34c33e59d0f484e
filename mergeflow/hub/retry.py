"""Retries for Hugging Face Hub calls: classify a failure, back off on transient ones, scrub tokens.

huggingface_hub 2.x speaks HTTP through httpx2. HTTP errors arrive as `HfHubHTTPError`
(a subclass of `httpx2.HTTPError`) with the status at `err.response.status_code`; network
failures arrive as `httpx2.TransportError`s, sometimes wrapped (`RuntimeError` from the LFS
thread pool, `LocalEntryNotFoundError` from downloads), so the whole cause chain is read.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Literal, TypeVar

import httpx2
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from mergeflow.errors import (
    MergeflowError,
    UploadAuthError,
    UploadError,
    UploadTransientError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
FailureKind = Literal["transient", "auth", "other"]

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Hugging Face user tokens look like hf_<34+ letters>; scrubbed even when we were never told the value.
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{20,}")


@dataclass(frozen=True)
class HubFailure:
    """What went wrong in a Hub call: kind, HTTP status if any, and the server's Retry-After in seconds."""

    kind: FailureKind
    status: int | None = None
    retry_after: float | None = None


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # the HTTP-date form
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def classify_hub_error(exc: BaseException) -> HubFailure:
    """Sort a Hub call's exception into transient (retry), auth (stop, fix credentials) or other (stop)."""
    for err in _cause_chain(exc):
        if isinstance(err, OfflineModeIsEnabled):
            return HubFailure("other")  # a setting, not the network: retrying cannot help
        if isinstance(err, (RevisionNotFoundError, RemoteEntryNotFoundError)):
            return HubFailure("other", err.response.status_code)
        if isinstance(err, (RepositoryNotFoundError, GatedRepoError)):
            return HubFailure("auth", err.response.status_code)
        if isinstance(err, HfHubHTTPError) and err.response is not None:
            status = err.response.status_code
            if status in (401, 403, 404):
                return HubFailure("auth", status)
            if status in TRANSIENT_STATUS:
                return HubFailure("transient", status, _parse_retry_after(err.response.headers.get("Retry-After")))
            return HubFailure("other", status)
        if isinstance(err, (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
            return HubFailure("transient")
        if isinstance(err, (ConnectionError, TimeoutError)):
            return HubFailure("transient")
    return HubFailure("other")


def scrub(text: str, secrets: Sequence[str | None]) -> str:
    """Replace every known secret and anything shaped like a Hugging Face token with '***'."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return _TOKEN_PATTERN.sub("***", text)


def describe(exc: BaseException, secrets: Sequence[str | None]) -> str:
    """One scrubbed line naming the exception and its message (plus the root cause when wrapped)."""
    parts = [f"{type(exc).__name__}: {exc}"]
    root = list(_cause_chain(exc))[-1]
    if root is not exc:
        parts.append(f"caused by {type(root).__name__}: {root}")
    line = " ".join(" ".join(parts).split())
    return scrub(line if len(line) <= 600 else line[:597] + "...", secrets)


def _auth_advice(status: int | None, repo_id: str) -> str:
    if status == 403:
        return (
            f"the token has no write access to {repo_id}: use a write token for that user or organisation "
            "(fine-grained tokens need write permission on the repo), via `hf auth login` or HF_TOKEN"
        )
    if status == 404:
        return (
            f"repository {repo_id} was not found or is not visible with this token: check the ORG/REPO name "
            "and that the token belongs to an account with access (`hf auth whoami`)"
        )
    return "the Hub rejected the credentials: run `hf auth login` or set HF_TOKEN to a token with write access"


def call_with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    repo_id: str,
    secrets: Sequence[str | None],
    max_attempts: int = 5,
    base_delay: float = 1.0,
    max_delay: float = 60.0,
) -> T:
    """Run one Hub step, retrying transient failures with exponential backoff (honouring Retry-After).

    Auth failures raise UploadAuthError at once, other failures UploadError, and transient ones
    UploadTransientError once `max_attempts` are spent. huggingface_hub retries some calls
    internally (preupload, LFS transfers, tree listing: at most 5 retries capped at 8 s each), so
    the worst case is bounded by max_attempts times that. Original exceptions are not chained:
    their text is scrubbed of tokens and copied into the message instead.
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    for attempt in range(1, max_attempts + 1):
        try:
            return fn()
        except MergeflowError:
            raise
        except Exception as exc:  # classified below; anything unknown is reported, not retried
            failure = classify_hub_error(exc)
            detail = describe(exc, secrets)
        status = f" (HTTP {failure.status})" if failure.status else ""
        if failure.kind == "auth":
            raise UploadAuthError(f"{what} on {repo_id} failed{status}: {_auth_advice(failure.status, repo_id)}. [{detail}]")
        if failure.kind == "other":
            raise UploadError(f"{what} on {repo_id} failed{status}: {detail}")
        if attempt == max_attempts:
            raise UploadTransientError(
                f"{what} on {repo_id} still failing after {max_attempts} attempts{status}: {detail}. "
                "The Hub or the network is having trouble; the local artifact is unchanged, rerun the upload later."
            )
        delay = failure.retry_after if failure.retry_after is not None else base_delay * 2 ** (attempt - 1)
        delay = min(delay, max_delay)
        logger.warning("%s on %s failed%s, retrying in %.1fs (attempt %d/%d): %s", what, repo_id, status, delay, attempt, max_attempts, detail)
        time.sleep(delay)
    raise AssertionError("unreachable")  # the loop always returns or raises
