"""``storage_options``: checking them, hiding their credentials, and telling the file
system below not to retry on its own.

- :func:`redact` is the one function through which anything derived from
  ``storage_options`` reaches a message, a log line, a ``repr`` or a file: the values of
  credential-like keys (``key``, ``secret``, ``token``, ``password``,
  ``aws_secret_access_key``, ``session_token``...) become ``"***"``, and so does the
  password of a URL (``http://user:pass@host``); given the options, a text (an error
  message of botocore or aiohttp, which may quote an endpoint) has each of their secret
  values replaced too.
- :func:`check_options` refuses options that are not a mapping of plain values, naming
  only the offending key or type (never a value).
- :func:`backend_options` and :func:`quiet_retries` make the layers below mmcache make one
  attempt per call (botocore ``total_max_attempts=1``, s3fs ``retries=1``, gcsfs's retry
  decorator bypassed) with timeouts from the :class:`~mmcache.sources.blobs.retry.RetryPolicy`:
  one retry policy, mmcache's, decides how long an outage costs. Options the user set
  explicitly win (``config_kwargs={"retries": ...}``).

Pure functions; thread-safe.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Mapping
from typing import Any

from mmcache.errors import ConfigError

__all__ = ["SECRET_NAMES", "backend_options", "check_options", "quiet_retries", "redact"]

#: Keys whose values are credentials (compared in lower case); also any key ending in
#: one of :data:`_SECRET_ENDINGS`.
SECRET_NAMES = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "session_token",
        "access_key",
        "secret_key",
        "account_key",
        "sas_token",
        "credentials",
        "client_secret",
        "authorization",
        "private_key",
        "api_key",
    }
)
_SECRET_ENDINGS = ("_secret", "_token", "_password", "_key", "_credentials")
_MASK = "***"
#: ``scheme://user:password@`` in any text: the password is masked.
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)([^@\s/]+)@")


def _is_secret(name: object) -> bool:
    text = str(name).lower()
    return text in SECRET_NAMES or text.endswith(_SECRET_ENDINGS)


def _secret_values(options: Any, out: set[str]) -> set[str]:
    if isinstance(options, Mapping):
        for k, v in options.items():
            if _is_secret(k):
                if isinstance(v, str) and len(v) >= 4:
                    out.add(v)
                elif v is not None:
                    _all_strings(v, out)
            else:
                _secret_values(v, out)
    elif isinstance(options, (list, tuple)):
        for v in options:
            _secret_values(v, out)
    elif isinstance(options, str):
        for m in _USERINFO.finditer(options):
            if len(m.group(2)) >= 4:
                out.add(m.group(2))
    return out


def _all_strings(value: Any, out: set[str]) -> None:
    if isinstance(value, str):
        if len(value) >= 4:
            out.add(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _all_strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _all_strings(v, out)


def redact(value: Any, options: Mapping[str, Any] | None = None) -> Any:
    """``value`` with its credentials hidden (see the module docstring): a mapping's
    secret-named values become ``"***"`` (recursively), a URL's password is masked, and
    with ``options`` every secret value of them found in a text is masked as well.

    >>> redact({"key": "AKIA123", "client_kwargs": {"endpoint_url": "http://u:pw12@h"}})
    {'key': '***', 'client_kwargs': {'endpoint_url': 'http://u:***@h'}}
    >>> redact("denied for SeCrEt99", {"secret": "SeCrEt99"})
    'denied for ***'
    """
    if isinstance(value, Mapping):
        return {k: _MASK if _is_secret(k) else redact(v, options) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, options) for v in value)
    if isinstance(value, str):
        text = _USERINFO.sub(lambda m: f"{m.group(1)}{_MASK}@", value)
        if options:
            for secret in sorted(_secret_values(options, set()), key=len, reverse=True):
                text = text.replace(secret, _MASK)
        return text
    return value


def check_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` as a plain dict; a :class:`ConfigError` naming the offending
    key or type (never a value: it may be a credential)."""
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping):
        raise ConfigError(
            f"storage_options must be a dict (e.g. {{'anon': True}}), "
            f"got a {type(storage_options).__name__}"
        )
    options = dict(storage_options)
    for name, value in options.items():
        if not isinstance(name, str):
            raise ConfigError(f"storage_options keys must be str, got a {type(name).__name__}")
        try:
            json.dumps(value, default=_refuse)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"storage_options[{name!r}] must hold plain values (str, numbers, bool, "
                f"lists, dicts): {exc}"
            ) from None
    return options


def _refuse(value: object) -> object:
    # Objects fsspec accepts as options (an aiohttp.ClientTimeout, a botocore Config) are
    # allowed; only their type is ever named in a message.
    if isinstance(value, (set, frozenset, bytes)):
        raise TypeError(f"a {type(value).__name__} is not a plain value")
    return f"<{type(value).__name__}>"


def backend_options(
    scheme: str, options: Mapping[str, Any], *, connect_timeout: float, read_timeout: float
) -> dict[str, Any]:
    """The keyword arguments of ``scheme``'s fsspec file system: ``options`` plus what makes
    its own layer make one attempt per call with these timeouts (user settings win)."""
    out = dict(options)
    if scheme in ("s3", "s3a"):
        config = dict(out.get("config_kwargs") or {})
        # botocore's "max_attempts" counts retries (max_attempts=1 is two tries, with up
        # to a second of jittered sleep between): "total_max_attempts" counts tries.
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", connect_timeout)
        config.setdefault("read_timeout", read_timeout)
        out["config_kwargs"] = config
    return out


def quiet_retries(fs: Any) -> Any:
    """Make the file system ``fs`` (just made, this process's own) make one attempt per
    call: s3fs's retry loop is told ``retries=1``; gcsfs's request method, decorated with
    a fixed retry loop of 6 attempts (about 31 s of backoff on an outage, not settable per
    instance), is replaced on this instance by the undecorated one. A file system of
    another kind is returned as it is (fsspec's HTTP one does not retry)."""
    module = type(fs).__module__
    if module.startswith("s3fs") and isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1
    elif module.startswith("gcsfs"):
        request = getattr(type(fs), "_request", None)
        inner = getattr(request, "__wrapped__", None)
        if inner is not None:
            fs._request = types.MethodType(inner, fs)
    return fs
