"""What logs may show of a configuration: credentials replaced, everything else as it is.

A service logs its effective flags at start-up, and `pagemesh up` the command line of each
child; both go to files and log collectors many more people read than may call the mesh.
Secrets (pagemesh.runtime.service_flags' `secret` flags: API keys) are replaced by how many there
are, and a URL's password (`redis://user:password@host`) by `***`. TLS flags hold paths,
which stay: the files' contents are never in a flag.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pagemesh.runtime.service_flags import SECRET_DESTS

# scheme://[user]:password@ — the password is everything up to the last @ of the authority.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[a-z][a-z0-9+.-]*://[^/:@\s]*:)(?P<password>[^/\s]*)@", re.IGNORECASE
)
# Flag names that say they hold a credential (not `max_num_batched_tokens`: whole words).
_SECRET_NAME = re.compile(r"(^|_)(password|secret|api_key)(_|$)|(^|_)token$")
REDACTED = "***"


def redact_url(text: str) -> str:
    """`text` with the password of every URL in it replaced."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}@", text)


def redacted_config(values: Mapping[str, Any]) -> dict[str, Any]:
    """`vars(args)` fit to log: secrets shown by count, URL passwords masked."""
    shown: dict[str, Any] = {}
    for name, value in values.items():
        if value in (None, "", []) or isinstance(value, bool):
            shown[name] = value
        elif name in SECRET_DESTS or _SECRET_NAME.search(name):
            count = len(value) if isinstance(value, list) else 1
            shown[name] = f"<{count} redacted>"
        elif isinstance(value, str):
            shown[name] = redact_url(value)
        else:
            shown[name] = value
    return shown


def redacted_argv(argv: Iterable[str]) -> list[str]:
    """A command line fit to log (secrets never travel in one: only URLs are masked)."""
    return [redact_url(word) for word in argv]
