"""Who may reach a service: secure by default, explicit when not (issue 48).

A service bound to loopback (127.0.0.0/8, ::1, ``localhost``) is reachable from this machine
only and may run without a token. Bound to anything else (``0.0.0.0``, ``::``, an interface's
address, a host name) it refuses to start without one, unless the one explicit opt-out for a
trusted network (``--insecure-no-token``) is given, which is logged loudly. Host names other
than ``localhost`` are not resolved: they count as non-loopback (fail closed). The batching
API and the patched vLLM server both use this; their route tables: api/README.md (Access) and
docs/BRIDGE.md (Routes and auth).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

OPT_OUT_FLAG = "--insecure-no-token"
"""The one spelling of the opt-out (the ``insecure_no_token`` field of each service's config)."""


class UnsafeBind(SystemExit):
    """A non-loopback bind without a token and without the opt-out: the service exits with
    this message (a non-zero status)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); anything else, a wildcard
    or an unresolved name included, is not."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def check_bind(
    service: str, host: str, has_token: bool, insecure_no_token: bool, how_to_set: str
) -> str | None:
    """``None`` when ``host`` may be served as configured; the warning to log loudly when it is
    served without a token by the opt-out; raises :class:`UnsafeBind` (exit 1 with the reason
    and the fix) when it must not be served. ``how_to_set``: how this service takes a token."""
    if has_token or is_loopback(host):
        return None
    if insecure_no_token:
        return (
            f"INSECURE: {service} serves on {host!r} WITHOUT A TOKEN ({OPT_OUT_FLAG}): anyone who "
            f"can reach this address can use every route of it. Use this on a trusted private "
            f"network only; set a token ({how_to_set}) anywhere else."
        )
    raise UnsafeBind(
        f"{service}: refusing to serve on {host!r} without a token: it is not a loopback "
        f"address, so other machines could reach every route of it. Set a token ({how_to_set}) "
        f"and give it to the clients, or bind loopback (--host 127.0.0.1), or, on a trusted "
        f"private network only, pass {OPT_OUT_FLAG}."
    )


def same_secret(given: bytes | str, expected: bytes | str) -> bool:
    """Constant-time comparison, its time independent of both lengths (hashes compared)."""
    a = given.encode() if isinstance(given, str) else given
    b = expected.encode() if isinstance(expected, str) else expected
    return hmac.compare_digest(hashlib.sha256(a).digest(), hashlib.sha256(b).digest())
