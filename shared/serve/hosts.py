"""Which hosts are this machine's loopback: the gateway's guard (shared/serve/http_guard.py)
and `up`'s API-key rule (cli/up_cmd.py) ask the same question. Its own module, free of
aiohttp, so that `up` asks it before the memory probe without the HTTP stack in its pages
(the parent's pages count against the budget: shared/experts/budget.py)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`host` (a name or address, no port) is this machine's loopback."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
