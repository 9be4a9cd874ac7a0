"""Who a batch runs as: the principal of the key that created it, found the way the request path
finds a caller — the policy file's keys first, then the key directory (keys made through
`POST /admin/keys` or `tokenway keys create`, in SQLite or Redis).

A batch keeps only its creator's key id (never the secret), so the runner cannot re-authenticate
the way a request does; it looks the id up instead. Looking only in the policy file made every
batch of an API-made key fail with "The API key that created this batch is no longer valid". A key
that is disabled, revoked, expired or whose tenant is gone has no principal: its batch fails (or its
remaining lines do), as a request with it would be refused.
"""

from __future__ import annotations

from policies.policy import Policy
from policies.types import Principal


def owner_principal(policy: Policy, key_id: str) -> Principal | None:
    """The principal of the key `key_id` as the request path would see it now, or None."""
    principal = policy.principal_of(key_id)
    if principal is not None:
        return principal
    directory = policy.directory
    record = directory.keys.get(key_id) if directory is not None else None
    if directory is None or record is None or record.revoked_at_unix_s is not None:
        return None
    # The directory's own authentication of the key's current digest: its expiry check and its
    # cached principal, compiled against this policy exactly as for a request.
    return directory.authenticate(bytes.fromhex(record.sha256), record.sha256, policy)
