"""Who owns a request: ids scoped per API key, and a request's fingerprint.

Several teams share one mesh, each with its own key. A client's request id is its own name
for its request, not a name in a space every tenant shares: the router turns it into the
mesh's id (`Tenancy.mesh_request_id`), a keyed hash (HMAC-SHA256) of the caller's key
fingerprint and the client's id. So key B sending key A's id reaches a different checkpoint
(none), exactly as if the id were unknown: a resume is NOT_FOUND, a new request is B's own.
Nothing downstream sees a client's id or key: the scheduler, the checkpoints in Redis, the
logs and the spans carry the hashed id; the checkpoint also records the key's fingerprint
(`owner`) and the request's (`request_digest`), checked again when it is loaded.

The HMAC secret is the mesh's, shared by every router through the registry (created once,
`Registry.shared_secret`): a router restarted, or another one, maps the same (key, id) to the
same mesh id, which is what a resume on any router needs. Whoever reads Redis can read the
secret, but whoever reads Redis reads the prompts too: the hashes keep ids and keys out of
logs, traces and metrics backends, which many more people read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

from pagemesh.runtime.auth import ApiKeys, bearer_token
from router.types import GenerationRequest

SECRET_NAME = "tenancy"  # the registry's `<cluster>:secret:tenancy`


class Tenancy:
    def __init__(self, secret: bytes, api_keys: ApiKeys | None = None) -> None:
        if len(secret) < 16:
            raise ValueError("the tenancy secret must be at least 16 bytes")
        self._secret = secret
        self.api_keys = api_keys or ApiKeys([])

    def owner(self, authorization: str | None) -> str:
        """The fingerprint of the key an `authorization` value carries (the API adapters
        pass what the caller sent, already checked), as checkpoints record it; "" with keys
        off: then every caller is one tenant."""
        if not self.api_keys.enabled:
            return ""
        key = bearer_token(authorization)
        return self._mac(b"owner", key)[:32] if key else ""

    def mesh_request_id(self, owner: str, client_id: str) -> str:
        """The id the mesh knows the request by: the same for the same (owner, client id) on
        every router, unrelated across owners, and telling nothing of either."""
        return "r" + self._mac(b"request", f"{owner}\0{client_id}")[:32]

    def _mac(self, purpose: bytes, text: str) -> str:
        message = purpose + b"\0" + text.encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def request_digest(request: GenerationRequest) -> str:
    """A fingerprint of what the client asked for (prompt, parameters, constraint), not of
    how it asked (its id, resume point, key): the same request sent again, to resume it,
    has the same digest; another request under a reused id has another. "" when the
    request states no prompt (a bare resume by id: there is nothing to compare)."""
    if request.prompt is None:
        return ""
    stated = dataclasses.asdict(request)
    for how in ("request_id", "resume_from", "new_request", "owner"):
        stated.pop(how, None)
    # Images by content (their bytes as text would cost megabytes of JSON); a remote
    # image by its URL, as the client stated it.
    stated["images"] = [
        hashlib.sha256(i).hexdigest() if isinstance(i, bytes) else i for i in request.images
    ]
    text = json.dumps(stated, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
