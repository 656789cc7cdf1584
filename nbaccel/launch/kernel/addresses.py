"""Ports and addresses of a launch: free ports, a port taken before anything starts, loopback and local
addresses, the address to bind for a master address."""

from __future__ import annotations

import socket

from ...utils.other import get_free_port
from ..errors import PortInUseError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now and that no outgoing connection can take before the ranks
    bind it (utils.other.get_free_port says why)."""
    return get_free_port(host)


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise PortInUseError naming `port` if something listens on it (or it cannot be bound) on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"use_port={port} is already in use on {host} ({exc.strerror}). Another launch or program holds "
                "it: pass a different use_port, or use_port=None to pick a free one."
            ) from None


def is_loopback_address(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (127.x, ::1, localhost)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def interface_addresses() -> set[str]:
    """The addresses of this machine's network interfaces (IPv4 and IPv6), via psutil."""
    try:
        import psutil

        return {entry.address.split("%")[0] for entries in psutil.net_if_addrs().values() for entry in entries
                if entry.family in (socket.AF_INET, socket.AF_INET6)}
    except Exception:
        return set()


def is_local_address(host: str) -> bool:
    """Whether `host` is this machine: loopback, the wildcard, its host name or one of its interfaces'
    addresses (e.g. its LAN address), so a port on it can be checked before anything starts."""
    if host in ("0.0.0.0", socket.gethostname()) or is_loopback_address(host):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address in interface_addresses()


def bind_address(host: str) -> str:
    """The address to test a port on for a local `host`: loopback for names of it and the wildcard, else the
    host's own address (a port can be busy on the LAN address only)."""
    if host in ("localhost", "0.0.0.0") or is_loopback_address(host):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
