"""Transports: one file each, declared once here, looked up by name.

| name       | reach                    | how bytes move                                           |
|------------|--------------------------|----------------------------------------------------------|
| inproc     | same process             | source -> destination, one copy (or none)                |
| shm        | same host                | source -> shared ring slot -> each receiver              |
| tcp        | any host                 | source memory -> socket -> destination memory            |
| collective | any hosts, a group       | source -> bucket -> rank 1 -> rank 2 ... (gloo chain)    |
| cudaipc    | same GPU, other process  | held tensors read in place, the rest via a GPU ring      |
| nixl       | any hosts (RDMA)         | source memory -> NIXL write -> destination memory        |

A transport is a `TransportSpec` (base.py): a link kind for the conversation and two data
planes. Adding one is a new file defining `SPEC` and a line in `REGISTRY`; no other module names
transports. Modules are imported on first use, so `import weightsync` pulls in none of them.
"""

from __future__ import annotations

import importlib

from weightsync.errors import ConfigError
from weightsync.transports.base import TransportSpec
from weightsync.transports.links import check_address as check_link_address

__all__ = [
    "REGISTRY",
    "TransportSpec",
    "check_address",
    "get_transport",
    "names",
    "scheme_of",
    "serving_transports",
]

REGISTRY: dict[str, str] = {
    "inproc": "weightsync.transports.inproc",
    "shm": "weightsync.transports.shm",
    "tcp": "weightsync.transports.tcp",
    "collective": "weightsync.transports.collective",
    "cudaipc": "weightsync.transports.cudaipc",
    "nixl": "weightsync.transports.nixl",
}
"""Transport name -> the module that defines its `SPEC`."""


def names() -> list[str]:
    return list(REGISTRY)


def serving_transports() -> list[str]:
    """The transports a receiver in another process than the sender can use (a rollout server)."""
    return [name for name in REGISTRY if get_transport(name).across_processes]


def get_transport(name: str) -> TransportSpec:
    """The transport called `name`; ConfigError naming the known ones otherwise."""
    module = REGISTRY.get(name)
    if module is None:
        raise ConfigError(f"unknown transport {name!r}; expected one of {sorted(REGISTRY)}")
    spec = importlib.import_module(module).SPEC
    if not isinstance(spec, TransportSpec) or spec.name != name:
        raise ConfigError(f"{module}.SPEC does not declare transport {name!r}")
    return spec


def scheme_of(address: str) -> str:
    """The transport name an address belongs to: "tcp" for "tcp://127.0.0.1:5555"."""
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in REGISTRY:
        raise ConfigError(f"address {address!r} names no known transport; expected one of {sorted(REGISTRY)}://...")
    return scheme


def check_address(address: str) -> TransportSpec:
    """The transport of `address`; ConfigError unless the address is well formed for it (no I/O)."""
    spec = get_transport(scheme_of(address))
    check_link_address(address, spec.name, spec.link)
    return spec
