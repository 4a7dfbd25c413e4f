"""`"host:port"` addresses, and the checks every cluster source shares.

`parse_address` is public; `check_addresses` and `check_index` are what the
sources (`explicit`, `tf_config`, `slurm`) and `ClusterInfo` validate with,
each passing its own names for the fields so messages point at what the
user wrote (`TF_CONFIG cluster.worker[1]`, `cluster['ps'][0]`, ...).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Mapping, Optional, Sequence

from .errors import ClusterConfigError

__all__ = ["check_addresses", "check_index", "parse_address"]


def parse_address(address: Any, field: str = "address") -> tuple[str, int]:
    """Splits `"host:port"` into `(host, port)`, checking both.

    IPv6 hosts must be bracketed (`"[::1]:2222"`); the returned host keeps
    the brackets off (`"::1"`).

    Args:
        address: the string to check.
        field: how error messages name the value, e.g. `"cluster.worker[1]"`.

    Raises:
        ClusterConfigError: not a string, a URL scheme, whitespace, no port,
            a port that is not an integer in 1..65535, an empty host, or an
            unbracketed IPv6 address.

    Example:

    ```python
    parse_address("10.0.0.1:2222")  # ("10.0.0.1", 2222)
    parse_address("[::1]:2222")     # ("::1", 2222)
    ```
    """
    if not isinstance(address, str):
        raise ClusterConfigError(
            f"{field}={address!r} must be a 'host:port' string, e.g. 'localhost:2222'."
        )
    if "://" in address:
        raise ClusterConfigError(
            f"{field}={address!r} has a URL scheme; write it as plain 'host:port'."
        )
    if any(c.isspace() for c in address):
        raise ClusterConfigError(
            f"{field}={address!r} contains whitespace; write it as 'host:port'."
        )
    if address.startswith("["):
        host, port_text = _split_bracketed(address, field)
    else:
        if address.count(":") > 1:
            raise ClusterConfigError(
                f"{field}={address!r} looks like an IPv6 address; bracket the "
                "host, e.g. '[::1]:2222'."
            )
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ClusterConfigError(
                f"{field}={address!r} has no port; write it as 'host:port', e.g. '{address}:2222'."
            )
    if not host:
        raise ClusterConfigError(
            f"{field}={address!r} has an empty host; write it as 'host:port', "
            f"e.g. 'localhost{address}'."
        )
    return host, _parse_port(port_text, address, field)


def _split_bracketed(address: str, field: str) -> tuple[str, str]:
    host, sep, rest = address[1:].partition("]")
    if not sep or not rest.startswith(":"):
        raise ClusterConfigError(
            f"{field}={address!r} has no port after the bracketed host; "
            "write it as '[host]:port', e.g. '[::1]:2222'."
        )
    if host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(
                f"{field}={address!r}: {host!r} is not an IPv6 address; only "
                "IPv6 hosts take brackets."
            ) from None
    return host, rest[1:]


def _parse_port(port_text: str, address: str, field: str) -> int:
    # int() accepts "+1", " 1" and "1_000"; a port is plain digits.
    if not port_text.isdigit() or not port_text.isascii():
        raise ClusterConfigError(
            f"{field}={address!r}: port {port_text!r} is not an integer; "
            "write it as 'host:port' with a port in 1..65535."
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(
            f"{field}={address!r}: port {port} is out of range; use a port in 1..65535."
        )
    return port


def check_addresses(addresses: Sequence[Any], fields: Sequence[str]) -> None:
    """Checks every address, and that no two are the same, across all roles.

    Args:
        addresses: every address of the cluster, whatever its role.
        fields: how messages name each address, one per address
            (`"TF_CONFIG cluster.ps[0]"`).

    Raises:
        ClusterConfigError: a malformed address (see `parse_address`), or
            two fields with the same address (host names compare
            case-insensitively), naming both fields.
    """
    seen: dict[str, str] = {}
    for address, field in zip(addresses, fields):
        parse_address(address, field)
        key = address.lower()  # host names are case-insensitive
        if key in seen:
            raise ClusterConfigError(
                f"{seen[key]} and {field} are both {address!r}; give each task its own host:port."
            )
        seen[key] = field


def check_index(index: Any, size: int, field: str, what: str) -> None:
    """Checks that `index` is an integer in `0..size-1`.

    Args:
        index: the value to check.
        size: how many tasks there are (>= 1).
        field: how messages name the value (`"TF_CONFIG task.index"`).
        what: how messages name the tasks (`"'worker' tasks"`).
    """
    # bool is an int subclass; "index": true is a typo, not rank 1.
    if index is None:
        raise ClusterConfigError(
            f"{field} is missing; set it to this process's index in 0..{size - 1}."
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterConfigError(f"{field}={index!r} must be an integer in 0..{size - 1}.")
    if index < 0:
        raise ClusterConfigError(
            f"{field}={index} is negative; set it to this process's index in 0..{size - 1}."
        )
    if index >= size:
        raise ClusterConfigError(
            f"{field}={index} is out of range for {size} {what}; use 0..{size - 1}."
        )


def whole_number(
    environ: Mapping[str, str], name: str, fix: str, default: Optional[int] = None
) -> int:
    """The environment variable `name` as a whole number (`default` when
    unset and one is given).

    Raises:
        ClusterConfigError: `<name>=<value> must be a whole number<fix>`,
            one line (`fix` says what the variable is, or how to set it).
    """
    value = environ.get(name)
    if value is None and default is not None:
        return default
    if value is None or not value.strip().isdigit():
        raise ClusterConfigError(f"{name}={value!r} must be a whole number{fix}")
    return int(value)
