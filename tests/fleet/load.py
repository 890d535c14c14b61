"""A bounded load client: streamed completions through the load balancer, counting what was lost.

    python -m tests.fleet.load --url http://10.249.0.1:8080 --rate 20 --duration 60 --out load.json

Bounded by construction: at most MAX_RATE requests a second for at most MAX_DURATION_S seconds, then
it stops by itself (SIGTERM stops it sooner: no new requests, the ones in flight finish). It refuses
any target but the loopback range and the fleet bed's own subnet. A request counts as failed when it
gets no 200 or its connection breaks, and as truncated when its stream ends without every token, a
finish_reason and `data: [DONE]`. With --haproxy-socket it also samples HAProxy every 0.1 s and
reports, per server, how long it was out of rotation (any status but UP, "UP 3/4" included). The
sampler goes on after the last request until SIGTERM (at most MAX_SAMPLE_S in all): a rollout on a busy
machine outlasts the load's bound, and a restart after it must still be seen out of rotation.

With --keepalive N, N clients each keep one HTTP/1.1 connection to the load balancer open and send
their requests over it one after another (the same rate in all): a drain must not cut such a kept-alive
connection, in a stream or between two. `reused` counts the requests that went over a connection an
earlier request had used; a connection that breaks is counted and opened again.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MAX_RATE = 20.0
MAX_DURATION_S = 120.0
MAX_SAMPLE_S = 900.0  # sampling HAProxy's stats socket sends no request: only SIGTERM or this ends it
ALLOWED_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("10.249.0.0/24"))


@dataclass
class Outcome:
    started: float
    seconds: float
    status: int | None
    served_by: str
    tokens: int
    done: bool  # the stream ended with a finish_reason and [DONE]
    error: str = ""
    reused: bool = False  # sent over a kept-alive connection an earlier request used

    @property
    def failed(self) -> bool:
        return self.status != 200 or bool(self.error)


def allowed_target(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return any(address in network for network in ALLOWED_NETWORKS)


def one_request(
    url: str, max_tokens: int, timeout: float, connection: http.client.HTTPConnection | None = None
) -> Outcome:
    """One streamed completion; on `connection` (kept open afterwards unless it broke) or a new one."""
    parts = urlsplit(url)
    began = time.monotonic()
    keep = connection is not None
    reused = keep and connection.sock is not None
    body = json.dumps(
        {
            "model": "glm-5",
            "prompt": "Say something",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    )
    if connection is None:
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    status: int | None = None
    served_by, tokens, finished, done = "", 0, False, False
    try:
        connection.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        status, served_by = response.status, response.getheader("x-served-by", "")
        if status != 200:
            response.read()
            keep = False
            return Outcome(
                began, time.monotonic() - began, status, served_by, 0, False, f"HTTP {status}", reused
            )
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += 1
                finished = finished or choice.get("finish_reason") is not None
        if response.will_close:
            keep = False
        return Outcome(
            began, time.monotonic() - began, status, served_by, tokens, done and finished, "", reused
        )
    except (OSError, http.client.HTTPException, ValueError) as exc:
        keep = False
        error = f"{type(exc).__name__}: {exc}"
        return Outcome(began, time.monotonic() - began, status, served_by, tokens, False, error, reused)
    finally:
        if not keep:
            connection.close()


class LbSampler(threading.Thread):
    """Seconds each server spent out of rotation, from HAProxy's `show stat` every `interval`."""

    def __init__(self, socket_path: str, backend: str, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import Runtime

        self.runtime, self.backend, self.interval = Runtime(socket_path, timeout=2), backend, interval
        self.downtime: dict[str, float] = {}
        self.statuses: dict[str, list[str]] = {}  # the distinct statuses each server went through, in order
        self.stop = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                rows = self.runtime.servers(self.backend)
            except Exception:  # a sample lost is not a request lost
                rows = {}
            for (_, server), row in rows.items():
                status = row.get("status", "?")
                self.downtime.setdefault(server, 0.0)
                seen = self.statuses.setdefault(server, [])
                if not seen or seen[-1] != status:
                    seen.append(status)
                # "UP 3/4" (a health check failed, not yet `fall` of them) still takes requests
                if not status.startswith("UP"):
                    self.downtime[server] += now - last
            last = now
            self.stop.wait(self.interval)


def run_load(
    url: str,
    rate: float,
    duration: float,
    max_tokens: int = 30,
    sampler: LbSampler | None = None,
    keepalive: int = 0,
) -> dict[str, Any]:
    if not allowed_target(url):
        raise SystemExit(f"refusing {url}: only loopback and the fleet bed's own addresses are targets")
    rate, duration = min(rate, MAX_RATE), min(duration, MAX_DURATION_S)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def worker() -> None:
        outcome = one_request(url, max_tokens, timeout=30)
        with lock:
            outcomes.append(outcome)

    if sampler:
        sampler.start()
    began = time.monotonic()
    threads = []
    sent = 0
    if keepalive > 0:
        # request i goes out at began + i / rate, on client i % keepalive's own connection; a client
        # whose stream is still running sends its next request when that one ends
        parts = urlsplit(url)
        counter = threading.Lock()
        total = int(rate * duration)
        next_index = [0]

        def client() -> None:
            nonlocal sent
            connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
            while True:
                with counter:
                    index = next_index[0]
                    if index >= total:
                        break
                    next_index[0] += 1
                if stop.wait(max(0.0, began + index / rate - time.monotonic())):
                    break
                with counter:
                    sent += 1
                outcome = one_request(url, max_tokens, 30, connection)
                with lock:
                    outcomes.append(outcome)
            connection.close()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(keepalive)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=duration + 90)
    else:
        for index in range(int(rate * duration)):
            if stop.wait(max(0.0, began + index / rate - time.monotonic())):
                break
            thread = threading.Thread(target=worker, daemon=True)
            thread.start()
            threads.append(thread)
        sent = len(threads)
        for thread in threads:
            thread.join(timeout=60)
    elapsed = time.monotonic() - began
    if sampler:
        stop.wait(max(0.0, began + MAX_SAMPLE_S - time.monotonic()))
        sampler.stop.set()
        sampler.join(timeout=5)
    failed = [o for o in outcomes if o.failed]
    truncated = [o for o in outcomes if not o.failed and (not o.done or o.tokens < max_tokens)]
    served: dict[str, int] = {}
    for outcome in outcomes:
        served[outcome.served_by or "-"] = served.get(outcome.served_by or "-", 0) + 1
    return {
        "url": url,
        "rate": rate,
        "seconds": round(elapsed, 2),
        "sent": sent,
        "answered": len(outcomes),
        "keepalive_clients": keepalive,
        "reused": sum(o.reused for o in outcomes),
        "ok": len(outcomes) - len(failed) - len(truncated),
        "failed": len(failed),
        "truncated": len(truncated),
        "lost": sent - len(outcomes) + len(failed) + len(truncated),
        "mean_request_s": round(sum(o.seconds for o in outcomes) / max(1, len(outcomes)), 3),
        "served_by": served,
        "lb_downtime_s": {k: round(v, 2) for k, v in (sampler.downtime if sampler else {}).items()},
        "lb_statuses": sampler.statuses if sampler else {},
        "errors": [asdict(o) for o in (failed + truncated)[:10]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, default=10.0, help=f"requests a second (at most {MAX_RATE:g})")
    parser.add_argument("--duration", type=float, default=30.0, help=f"seconds (at most {MAX_DURATION_S:g})")
    parser.add_argument("--max-tokens", type=int, default=30)
    parser.add_argument("--haproxy-socket")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--keepalive", type=int, default=0, help="clients that each keep one connection")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sampler = LbSampler(args.haproxy_socket, args.backend) if args.haproxy_socket else None
    summary = run_load(args.url, args.rate, args.duration, args.max_tokens, sampler, max(0, args.keepalive))
    text = json.dumps(summary, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
