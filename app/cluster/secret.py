"""The job secret (JOB_SECRET) and its proofs: the one place that signs and checks what the job's
processes tell each other through something anyone on its network can reach (the rendezvous store's
handshake, app/cluster/process_group.py; torchft mode's state transfer, app/ft/transport.py; inplace mode's
group store, app/ft/inplace.py).

A proof is an HMAC-SHA256 of its parts. Each user binds it to what it is about (a token and a
nonce, a step, a key's name and the job's namespace), so that a proof copied from one place is
worth nothing in another. Without a secret the proofs use an empty key: the same protocol and the
same checks of form, but no protection against anyone who computes them too.
"""
from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "JOB_SECRET"     # shared by every node of a job; `make up` makes one unless given


def job_key(secret: str | None = None) -> bytes:
    """The key the proofs use: `secret`, else the environment's JOB_SECRET, else empty."""
    return (os.environ.get(SECRET_ENV, "") if secret is None else secret).encode()


def proof(key: bytes, *parts: object) -> str:
    return hmac.new(key, "/".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def proves(key: bytes, said: str, *parts: object) -> bool:
    """Whether `said` is the proof of `parts` (in constant time; any text, even not hexadecimal)."""
    return hmac.compare_digest(said.encode(), proof(key, *parts).encode())
