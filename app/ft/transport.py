"""The state a returning replica group copies from a live one, over HTTP, only between holders of the job secret.

Why not torchft's own HTTPTransport: it serves the weights to anyone who can reach its port, and
the side that heals unpickles whatever answers (`torch.load(weights_only=False)`), so a stranger in
the quorum could both read the model and run code on the healing node. Here both sides prove they
hold the job secret (JOB_SECRET, app/cluster/secret.py) with an HMAC over a fresh nonce and the
step, the body carries an HMAC of its digest, and the receiver loads it with `weights_only=True`
after checking it. Without a secret the proofs use an empty key: the same protocol, no protection
(as for the elastic mode's handshake).
"""
from __future__ import annotations

import hashlib
import io
import threading
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from app.cluster.secret import SECRET_ENV, job_key, proof, proves
from app.core.policy import DEFAULT
from app.recovery import threads
from app.training.snapshot import map_tensors

PROOF_HEADER = "X-Job-Proof"


class StateRefused(RuntimeError):
    """The other side could not prove it holds the job secret; nothing was loaded or sent."""


class SecretTransport(CheckpointTransport[Any]):
    """torchft's CheckpointTransport: one state at a time, served at /state/STEP to the job's members."""

    def __init__(self, advertised_host: str, secret: str | None = None,
                 stage_wait_s: float = DEFAULT.ft_stage_wait_s) -> None:
        self._key = job_key(secret)
        self._stage_wait_s = stage_wait_s   # the Manager's timeout bounds a request too
        self._lock = threading.Condition()   # a request for a step not served yet waits for it
        self._step: int | None = None       # the step being served; None: nothing to serve
        self._body = b""
        self.refused: list[str] = []        # addresses refused, for the trainer's warning line
        self._server = _Server(("", 0), self._handler())
        self._host = advertised_host
        threads.start("state-server", self._server.serve_forever)

    # ------------------------------------------------------------ serving side

    def metadata(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._server.server_address[1]}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        buffer = io.BytesIO()
        torch.save(map_tensors(state_dict, lambda t: t.detach().cpu()), buffer)    # serialized at once: no copy
        with self._lock:
            self._step, self._body = step, buffer.getvalue()
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._step, self._body = None, b""

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._stage_wait_s
            def do_GET(self) -> None:
                step, _, nonce = self.path.removeprefix("/state/").partition("?nonce=")
                if not proves(transport._key, self.headers.get(PROOF_HEADER, ""), "fetch", step, nonce):
                    transport.refused.append(self.client_address[0])
                    self.send_error(403, "the job secret does not match")
                    return
                # The healing group may ask before this one, in its own quorum thread, has staged the step.
                with transport._lock:
                    transport._lock.wait_for(lambda: str(transport._step) == step, timeout=self.timeout)
                    serving, body = transport._step, transport._body
                if str(serving) != step:
                    self.send_error(409, f"serving step {serving}, not {step}")
                    return
                self.send_response(200)
                self.send_header(PROOF_HEADER, proof(transport._key, "state", step, nonce,
                                                     hashlib.sha256(body).hexdigest()))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass        # a request per heal; the trainer says what matters

        return Handler

    # ------------------------------------------------------------ healing side

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        nonce = uuid.uuid4().hex
        request = urllib.request.Request(f"{metadata}/state/{step}?nonce={nonce}",
                                         headers={PROOF_HEADER: proof(self._key, "fetch", step, nonce)})
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as answer:
                body, said = answer.read(), answer.headers.get(PROOF_HEADER, "")
        except urllib.error.HTTPError as exc:
            if exc.code == 403:
                raise StateRefused(f"the replica group at {metadata} refused this one: they do not share the "
                                   f"job secret ({SECRET_ENV})") from None
            raise
        if not proves(self._key, said, "state", step, nonce, hashlib.sha256(body).hexdigest()):
            raise StateRefused(f"the replica group at {metadata} cannot prove it holds the job secret "
                               f"({SECRET_ENV}): its state was not loaded")
        return torch.load(io.BytesIO(body), weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    """The state server: one thread per request. Its port is open to anyone on the network, so a
    request that breaks its handler (a client gone mid-answer, a malformed request line) ends that
    request only; socketserver would print a traceback for each."""
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass        # the asking side sees its request fail; a member's heal retries at the next quorum
