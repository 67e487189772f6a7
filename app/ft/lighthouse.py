"""The torchft Lighthouse: decides, at every step, which replica groups train together.

    python -m app.ft.lighthouse            # binds [::]:LIGHTHOUSE_PORT (29510), the policy's timings

It holds no training state (a restart costs the replica groups one quorum), so it runs where the
rendezvous store runs: on the compose `store` service, not on a trainer node that may be killed.
The server is torchft's (Rust, in its wheel); this file only gives it the fault policy's timings.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Sequence

from app.core.errors import UserError, one_line_errors
from app.core.policy import FaultPolicy


def serve(policy: FaultPolicy, host: str = "[::]", min_replicas: int = 1) -> "LighthouseServer":
    from torchft.coordination import LighthouseServer

    bind = f"{host}:{policy.lighthouse_port}"
    try:
        return LighthouseServer(bind=bind, min_replicas=min_replicas,
                                join_timeout_ms=round(policy.ft_join_timeout_s * 1000),
                                quorum_tick_ms=round(policy.ft_quorum_tick_s * 1000),
                                heartbeat_timeout_ms=round(policy.ft_heartbeat_timeout_s * 1000))
    except Exception as exc:    # torchft raises a bare RuntimeError from Rust for a taken port
        raise UserError(f"the Lighthouse cannot listen on {bind}: {str(exc).splitlines()[0]}") from None


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m app.ft.lighthouse", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="[::]", help="address to bind (the port is LIGHTHOUSE_PORT)")
    p.add_argument("--min-replicas", type=int, default=1, help="replica groups a quorum needs")
    args = p.parse_args(argv)
    if args.min_replicas < 1:
        raise UserError(f"--min-replicas must be positive, got {args.min_replicas}")
    server = serve(FaultPolicy.from_env().check(), args.host, args.min_replicas)
    print(f"lighthouse: {server.address()} (min replicas {args.min_replicas})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    sys.exit(one_line_errors(lambda: main(sys.argv[1:])))
