"""What ``DynamicEmbTableOptions(external_storage=...)`` accepts, and opening it.

A directory path is ``RocksDBStorage``, ``"redis://host:port"`` ``RedisStorage``,
``"redis+cluster://host:port[,...]"`` ``RedisClusterStorage``; an open ``KVStore`` serves
one table group only. A spec opens one store per table group and rank, in namespace
``[<run>/]<table names>[.rank<r>]`` (a RocksDB subdirectory, a Redis key prefix). One
holding an earlier module's rows is refused unless the spec says ``resume=True``, which
takes them over if they have the module's row format (not that module's host rows:
``DynamicEmbLoad`` continues a run exactly).
"""

import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from dynamicemb.kvstore.store import KVStore

__all__ = ["RedisClusterStorage", "RedisStorage", "RocksDBStorage", "as_storage_spec",
           "namespace_of", "open_store"]

_RUN = re.compile(r"[A-Za-z0-9_.-]+")


def _check_run(kind: str, run: Optional[str], resume: bool) -> None:
    if run is not None and (not isinstance(run, str) or not _RUN.fullmatch(run)
                            or run in (".", "..")):
        raise ValueError(f"{kind} run must be a name of letters, digits, '_', '.' and '-', "
                         f"got {run!r}")
    if not isinstance(resume, bool):
        raise ValueError(f"{kind} resume must be True or False, got {resume!r}")


def _in_run(run: Optional[str], namespace: str) -> str:
    return namespace if run is None else f"{run}/{namespace}"


@dataclass(frozen=True)
class RocksDBStorage:
    """RocksDB under the local directory ``path``.

    Args:
        sync: make every write durable at once (slower); else ``flush`` does.
        run: this model's name, so models sharing ``path`` and table names do not collide.
        resume: take over the rows an earlier module left (module docstring).
    """

    path: str
    sync: bool = False
    run: Optional[str] = None
    resume: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"RocksDBStorage needs a directory path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        _check_run("RocksDBStorage", self.run, self.resume)

    def open(self, namespace: str, row_width: int, row_format: str) -> KVStore:
        """The store of ``namespace``, rows of ``row_width`` words of format ``row_format``
        (``KVStore``'s arguments)."""
        from dynamicemb.kvstore.rocksdb import RocksDBStore
        return RocksDBStore(os.path.join(self.path, _in_run(self.run, namespace)), row_width,
                            row_format, sync=self.sync, resume=self.resume)


@dataclass(frozen=True)
class RedisStorage:
    """One Redis (or Valkey) server at ``address``, ``host:port``.

    Args:
        timeout: seconds a reply may take before the step fails.
        run, resume: as ``RocksDBStorage``'s (``run`` prefixes the namespaces).
    """

    address: str
    timeout: float = 5.0
    run: Optional[str] = None
    resume: bool = False

    def __post_init__(self) -> None:
        _check_run("RedisStorage", self.run, self.resume)
        address = self.address
        if isinstance(address, (tuple, list)):
            if len(address) != 1:
                raise ValueError(_SEVERAL_SERVERS.format(", ".join(map(str, address))))
            address = address[0]
        if not isinstance(address, str) or not re.fullmatch(r"[^\s:,/]+:\d+", address):
            raise ValueError(f"RedisStorage address must be host:port, got {address!r}")
        if not self.timeout > 0:
            raise ValueError(f"RedisStorage timeout must be positive, got {self.timeout}")
        object.__setattr__(self, "address", address)

    def open(self, namespace: str, row_width: int, row_format: str) -> KVStore:
        """As ``RocksDBStorage.open``."""
        from dynamicemb.kvstore.redis import RedisStore
        return RedisStore(self.address, _in_run(self.run, namespace), row_width, row_format,
                          timeout=self.timeout, resume=self.resume)


_SEVERAL_SERVERS = (
    "several Redis servers ({}) are a Redis Cluster now: run them in cluster mode and give "
    "'redis+cluster://host:port,...' (RedisClusterStorage), which spreads keys by slot with "
    "replicas and failover. Rows an earlier version spread over several servers by its own "
    "hash are not read by either: load a checkpoint (DynamicEmbDump/DynamicEmbLoad)")


@dataclass(frozen=True)
class RedisClusterStorage:
    """A Redis Cluster (``dynamicemb.kvstore.redis_cluster``).

    Args:
        seeds: ``host:port`` of some of its nodes.
        timeout: seconds a reply may take before the step fails.
        run, resume: as ``RedisStorage``'s.
        replicas_to_wait: replicas each written primary must confirm before a write
            returns (``WAIT``); 0 is faster, but a failover may lose the last writes.
        wait_timeout: seconds a ``WAIT`` may take before the step fails.
    """

    seeds: Tuple[str, ...]
    timeout: float = 5.0
    run: Optional[str] = None
    resume: bool = False
    replicas_to_wait: int = 1
    wait_timeout: float = 2.0

    def __post_init__(self) -> None:
        _check_run("RedisClusterStorage", self.run, self.resume)
        seeds = (self.seeds,) if isinstance(self.seeds, str) else tuple(self.seeds)
        for a in seeds:
            if not re.fullmatch(r"[^\s:,/]+:\d+", a):
                raise ValueError(f"RedisClusterStorage seeds must be host:port, got {a!r}")
        if not seeds:
            raise ValueError("RedisClusterStorage needs at least one host:port")
        if not self.timeout > 0 or not self.wait_timeout > 0:
            raise ValueError("RedisClusterStorage timeout and wait_timeout must be positive, "
                             f"got {self.timeout} and {self.wait_timeout}")
        if (isinstance(self.replicas_to_wait, bool) or not isinstance(self.replicas_to_wait, int)
                or self.replicas_to_wait < 0):
            raise ValueError(f"replicas_to_wait must be an int >= 0, got {self.replicas_to_wait!r}")
        object.__setattr__(self, "seeds", seeds)

    def open(self, namespace: str, row_width: int, row_format: str) -> KVStore:
        """As ``RocksDBStorage.open``."""
        from dynamicemb.kvstore.redis_cluster import RedisClusterStore
        return RedisClusterStore(self.seeds, _in_run(self.run, namespace), row_width,
                                 row_format, timeout=self.timeout, resume=self.resume,
                                 replicas_to_wait=self.replicas_to_wait,
                                 wait_timeout=self.wait_timeout)


def as_storage_spec(value: Any):
    """The spec or store ``value`` names; ``ValueError`` if none (module docstring)."""
    if isinstance(value, (RocksDBStorage, RedisStorage, RedisClusterStorage, KVStore)):
        return value
    if isinstance(value, os.PathLike) or isinstance(value, str):
        text = os.fspath(value)
        if text.startswith("redis+cluster://"):
            return RedisClusterStorage(tuple(
                a for a in text[len("redis+cluster://"):].rstrip("/").split(",")))
        if text.startswith("redis://"):
            servers = text[len("redis://"):].rstrip("/").split(",")
            if len(servers) > 1:
                raise ValueError(_SEVERAL_SERVERS.format(", ".join(servers)))
            return RedisStorage(servers[0])
        return RocksDBStorage(text)
    raise ValueError(
        "external_storage must be a directory path (RocksDB), 'redis://host:port', "
        "'redis+cluster://host:port[,...]', a RocksDBStorage/RedisStorage/RedisClusterStorage "
        f"spec or a KVStore, got {type(value).__name__}")


def namespace_of(table_names, rank: int = -1) -> str:
    """A store namespace for a table group (and a rank, when >= 0)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", "+".join(table_names))
    return name if rank < 0 else f"{name}.rank{rank}"


def open_store(spec, namespace: str, row_width: int, row_format: str) -> KVStore:
    """``spec`` opened in ``namespace`` for rows of ``row_width`` words of format
    ``row_format`` (a ``RowFormat.tag``), or ``spec`` itself if it is an open store
    (``ExternalTier`` checks that its rows are the group's)."""
    if isinstance(spec, KVStore):
        return spec
    return spec.open(namespace, row_width, row_format)
