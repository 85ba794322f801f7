"""The network as `moe-pipe pull` meets it: fail fast when the Hub cannot be
reached at all, and say a retry in one short line.

    check_reachable(endpoint)   a PullError within REACH_TIMEOUT_S when the host does not
                                resolve, refuses the connection or does not answer
    quiet_retries()             huggingface_hub's retry warnings as one line per retry

huggingface_hub retries a failed request five times with backoff (1, 2, 4, 8, 8 s)
and logs two long lines for each try (the exception with the whole URL, then
"Retrying in 8s"): 24 s and eleven lines before the error, for a DNS failure
that no retry mends. One TCP connection to the endpoint's host (or the proxy
the environment names for it) before the first request tells those cases
apart in a few seconds; a connection that breaks later (mid-download) keeps
the library's retries, each shown as one line.
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import UserError

# DNS and the TCP handshake together: a resolver that does not answer (no network) can
# block getaddrinfo for its own timeout x attempts (10 s with glibc's defaults), so it
# runs on a thread that is left behind at the deadline.
REACH_TIMEOUT_S = 4.0
OFFLINE_HINT = (
    "check the network; or set HF_ENDPOINT to a mirror of the Hub; a GGUF copied here by hand runs by its path (moe-pipe up FILE.gguf)"
)
_HTTP_LOGGER = "huggingface_hub.utils._http"  # where the library's retry warnings come from


def _target(endpoint: str) -> tuple[str, int, str]:
    """(host, port, what to call it) the first request connects to: the endpoint, or its proxy."""
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return p.hostname or "", p.port or 80, f"the proxy {p.hostname}:{p.port or 80}"
    return host, port, endpoint


def _resolve(host: str, port: int, timeout_s: float) -> list[tuple]:
    """getaddrinfo with a deadline (it has none of its own)."""
    out: dict[str, object] = {}

    def work() -> None:
        try:
            out["addrs"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            out["error"] = exc

    t = threading.Thread(target=work, name="moe-pipe-resolve", daemon=True)
    t.start()
    t.join(timeout_s)
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    if "addrs" not in out:
        raise TimeoutError(f"no answer from the resolver in {timeout_s:.0f} s")
    return out["addrs"]  # type: ignore[return-value]


def check_reachable(endpoint: str, where: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A PullError-like UserError (one line with OFFLINE_HINT) when no TCP connection to
    the endpoint (or its proxy) can be made within `timeout_s`."""
    host, port, name = _target(endpoint)
    if not host:
        raise UserError(f"{where}: HF_ENDPOINT {endpoint!r} has no host name")
    try:
        addrs = _resolve(host, port, timeout_s)
    except socket.gaierror as exc:
        raise UserError(f"{where}: cannot reach {name}: {host} does not resolve ({exc.strerror}); {OFFLINE_HINT}") from None
    except (TimeoutError, OSError) as exc:
        raise UserError(f"{where}: cannot reach {name}: resolving {host}: {exc}; {OFFLINE_HINT}") from None
    family, kind, proto, _, addr = addrs[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout_s)
            s.connect(addr)
    except ConnectionRefusedError:
        raise UserError(f"{where}: cannot reach {name}: connection refused; {OFFLINE_HINT}") from None
    except TimeoutError:
        raise UserError(f"{where}: cannot reach {name}: no answer in {timeout_s:.0f} s; {OFFLINE_HINT}") from None
    except OSError as exc:
        raise UserError(f"{where}: cannot reach {name}: {exc.strerror or exc}; {OFFLINE_HINT}") from None


class RetryLines(logging.Handler):
    """huggingface_hub's pair of warnings per retry ("'ERR' thrown while requesting GET URL",
    "Retrying in 2s [Retry 2/5].") as one line: `moe-pipe: ERR; retry 2/5 in 2 s`."""

    def __init__(self, stream=None) -> None:
        super().__init__(logging.WARNING)
        self.stream = stream
        self.cause = ""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if m := re.match(r"'(.*)' thrown while requesting", text, re.S):
            self.cause = m.group(1).splitlines()[0][:120] if m.group(1) else "network error"
        elif m := re.match(r"HTTP Error (\d+) thrown", text):
            self.cause = f"HTTP {m.group(1)}"
        elif m := re.search(r"(?:Retrying in|Waiting) (\S+?)s.*\[Retry (\d+)/(\d+)\]", text):
            wait, n, total = m.groups()
            print(f"moe-pipe: {self.cause or 'network error'}; retry {n}/{total} in {float(wait):g} s", file=self.stream or sys.stderr)


@contextmanager
def quiet_retries(stream=None) -> Iterator[RetryLines]:
    """While inside, the library's retry warnings print as RetryLines (and nowhere else)."""
    log = logging.getLogger(_HTTP_LOGGER)
    handler = RetryLines(stream)
    was = log.propagate
    log.addHandler(handler)
    log.propagate = False  # not also through the library's own handler on "huggingface_hub"
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.propagate = was
