"""Which address the receiver may bind: loopback unless the caller explicitly opts in to the network.

The receiver has no authentication, and any trace it accepts ends up in reports, so exposing it is a
decision to make loudly, not a side effect of ``--host 0`` or an empty string.
"""

from __future__ import annotations

import ipaddress
import socket


class HostError(ValueError):
    """``--host`` is empty, does not resolve, or is not loopback without ``--allow-remote``."""


def check_host(host: str, allow_remote: bool = False) -> str:
    """The numeric address to bind for ``host``; raise ``HostError`` saying why it may not be used.

    ``host`` is resolved once here, so ``0`` or a name cannot bind something other than what was checked.
    """
    if not host or not host.strip():
        raise HostError("--host is empty; use 127.0.0.1 (the default) or ::1")
    try:
        infos = socket.getaddrinfo(host.strip(), None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise HostError(f"--host {host!r} does not resolve to an address ({exc})") from None
    address = str(infos[0][4][0])
    if is_loopback(address) or allow_remote:
        return address
    raise HostError(
        f"--host {host!r} is {address}, not loopback: the receiver has no authentication and would accept "
        "traces from the network; pass --allow-remote (Receiver(allow_remote=True)) if that is intended"
    )


def is_loopback(address: str) -> bool:
    """Whether the numeric ``address`` is a loopback address."""
    return ipaddress.ip_address(address.split("%")[0]).is_loopback
