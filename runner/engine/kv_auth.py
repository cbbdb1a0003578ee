"""P/D hand-over authentication: a producer signs each offer it hands out with a key it shares with its consumers,
and a consumer reads only what a producer signed, once, before the offer's lease ends (engine/kv_transfer.py says
what an offer holds).

Without this, anyone who can reach a consumer with its API key could name another session, regions, block ids or
release URL in kv_transfer_params: publish arbitrary bytes under a shared prompt's hashes, read another tenant's
blocks out of a producer's registered cache, stall the consumer's steps on a silent peer, or make it POST anywhere.

The signature is HMAC-SHA256 (hmac, hashlib) over the offer's canonical JSON (sorted keys, no spaces): every field
a consumer acts on (hashes, block ids, state blocks, ranks' sessions and regions, transfer id, block size, release
URL, and the lease's end as wall-clock seconds). A consumer verifies it with hmac.compare_digest before anything
else, refuses an offer whose lease has ended, and remembers each transfer id it took until that offer's lease would
end, so an offer is taken once.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import threading
import time
from pathlib import Path

from dsconv.errors import InputError

# HMAC-SHA256's own block is 64 bytes; 16 random bytes (128 bits) is the least a guess should have to beat
MIN_KEY_BYTES = 16
KEY_SOURCES = ("auth_key", "auth_key_file", "auth_key_env")
HOW_TO_KEY = (f"give P and D one shared secret of at least {MIN_KEY_BYTES} bytes in kv_connector_extra_config: "
              "\"auth_key_file\" (a file holding it), \"auth_key_env\" (an environment variable holding it) or "
              "\"auth_key\" (the secret itself)")


class AuthKey:
    """The shared secret: its bytes never appear in a repr, a log line or an error."""

    def __init__(self, secret: bytes):
        self._secret = secret

    def __repr__(self) -> str:
        return "AuthKey(<hidden>)"

    def __eq__(self, other) -> bool:
        return isinstance(other, AuthKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(AuthKey)

    def sign(self, payload: dict) -> str:
        """The hex HMAC-SHA256 of a payload's canonical JSON."""
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()

    def verify(self, payload: dict, signature: str) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(payload), signature)

    @classmethod
    def of(cls, extra: dict) -> AuthKey:
        """kv_connector_extra_config's one key source -> the key; InputError (one line, never the secret) else."""
        given = [name for name in KEY_SOURCES if name in extra]
        if not given:
            raise InputError(f"--kv-transfer-config: P/D hand-overs are signed: {HOW_TO_KEY}")
        if len(given) > 1:
            raise InputError(f"--kv-transfer-config: give one of {', '.join(given)}, not both")
        name, value = given[0], extra[given[0]]
        if not isinstance(value, str) or not value:
            raise InputError(f"--kv-transfer-config: {name} must be a non-empty string")
        if name == "auth_key_file":
            try:
                secret = Path(value).read_bytes().strip()
            except OSError as exc:
                raise InputError(f"--kv-transfer-config: auth_key_file {value!r} cannot be read "
                                 f"({exc.strerror})") from None
        elif name == "auth_key_env":
            if value not in os.environ:
                raise InputError(f"--kv-transfer-config: auth_key_env names {value!r}, which is not set")
            secret = os.environ[value].strip().encode()
        else:
            secret = value.encode()
        if len(secret) < MIN_KEY_BYTES:
            raise InputError(f"--kv-transfer-config: the key from {name} is {len(secret)} bytes; {HOW_TO_KEY}")
        return cls(secret)


class ReplayGuard:
    """The transfer ids a consumer took, until their offers' leases end (after which the expiry check refuses
    them anyway). The door's threads check offers at once, hence the lock."""

    def __init__(self):
        self._taken: dict[str, float] = {}  # transfer id -> its lease's end (time.time())
        self._ends: list[tuple[float, str]] = []  # a heap of the same, soonest end first
        self._lock = threading.Lock()

    def take(self, transfer_id: str, expires_at: float) -> None:
        """InputError when this transfer id was taken before; remembers it otherwise. Ids whose leases have ended
        are forgotten soonest first, so a call costs O(log n) however many offers are live."""
        now = time.time()
        with self._lock:
            while self._ends and self._ends[0][0] < now:
                _, gone = heapq.heappop(self._ends)
                self._taken.pop(gone, None)
            if transfer_id in self._taken:
                raise InputError(f"kv_transfer_params: transfer {transfer_id} was already taken: a producer's offer "
                                 f"is read once")
            self._taken[transfer_id] = expires_at
            heapq.heappush(self._ends, (expires_at, transfer_id))
