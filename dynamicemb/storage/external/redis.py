"""Rows on one or several Redis (or Valkey) servers (the ``redis`` package).

Keys are spread over the servers by ``server_of``: the upper bits of the key times
the 64-bit golden-ratio constant, XOR the table id, modulo the number of servers.
Every lookup and write is one pipelined ``MGET``/``MSET``/``DEL`` per server, with
binary values. Several ranks and tables share a server set through namespaces:
every key starts with ``<namespace>:``.
"""

from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from dynamicemb.storage.external.store import KVStore, unpack_keys

__all__ = ["RedisStore", "server_of"]

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_BATCH = 1 << 14  # keys per MGET/MSET command inside a pipeline


def server_of(keys: torch.Tensor, table_ids: torch.Tensor, num_servers: int) -> torch.Tensor:
    """The server index of each (key, table id): ``((key * 0x9E3779B97F4A7C15 mod 2**64)
    >> 33 XOR table_id) mod num_servers``.

    Shape:
        keys, table_ids: (n,); returns (n,) int64 in [0, num_servers).
    """
    mixed = (keys.to(torch.int64) * _GOLDEN) >> 33  # arithmetic shift: keep 31 bits
    return ((mixed & 0x7FFFFFFF) ^ table_ids.to(torch.int64)) % num_servers


class RedisStore(KVStore):
    """Rows on Redis servers.

    Args:
        addresses: ``host:port`` of each server (one or several).
        namespace: prefix of this store's keys (distinct per table group and rank).
        row_width: floats per row.
        timeout: seconds a connection or a reply may take before the verb fails.
    """

    def __init__(self, addresses: Sequence[str], namespace: str, row_width: int,
                 timeout: float = 5.0) -> None:
        super().__init__(f"redis://{','.join(addresses)}/{namespace}", row_width)
        try:
            import redis
        except ImportError as e:  # pragma: no cover - pinned in requirements.txt
            raise ImportError("RedisStore needs the redis package (pip install redis)") from e
        if not addresses:
            raise ValueError("RedisStore needs at least one host:port")
        if ":" in namespace or "*" in namespace:
            raise ValueError(f"namespace must not contain ':' or '*', got {namespace!r}")
        self.namespace = namespace
        self._prefix = namespace.encode() + b":"
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry
        # A lost connection is tried again twice, within about 0.2 s, then the verb fails.
        self._clients = [
            redis.Redis(host=host, port=int(port), socket_timeout=timeout,
                        socket_connect_timeout=timeout,
                        retry=Retry(ExponentialBackoff(cap=0.1, base=0.05), 2))
            for host, port in (a.rsplit(":", 1) for a in addresses)
        ]

    def _key_prefix(self) -> bytes:
        return self._prefix

    def _spread(self, keys: List[bytes]) -> List[Tuple[int, List[int]]]:
        """(server, positions of its keys) of the servers holding some of ``keys``."""
        if len(self._clients) == 1:
            return [(0, list(range(len(keys))))]
        server = server_of(*unpack_keys(keys), len(self._clients))
        return [(s, (server == s).nonzero().squeeze(1).tolist())
                for s in range(len(self._clients))]

    def _get(self, keys: List[bytes]) -> Sequence[Optional[bytes]]:
        out: List[Optional[bytes]] = [None] * len(keys)
        for s, at in self._spread(keys):
            mine = keys if len(at) == len(keys) else [keys[i] for i in at]
            pipe = self._clients[s].pipeline(transaction=False)
            for i in range(0, len(mine), _BATCH):
                pipe.mget(mine[i:i + _BATCH])
            got = [v for part in pipe.execute() for v in part]
            if len(at) == len(keys):
                out = got
            else:
                for i, v in zip(at, got):
                    out[i] = v
        return out

    def _put(self, keys: List[bytes], values: List[bytes]) -> None:
        for s, at in self._spread(keys):
            ks = keys if len(at) == len(keys) else [keys[i] for i in at]
            vs = values if len(at) == len(keys) else [values[i] for i in at]
            pipe = self._clients[s].pipeline(transaction=False)
            for i in range(0, len(ks), _BATCH):
                pipe.mset(dict(zip(ks[i:i + _BATCH], vs[i:i + _BATCH])))
            pipe.execute()

    def _delete(self, keys: List[bytes]) -> None:
        for s, at in self._spread(keys):
            ks = keys if len(at) == len(keys) else [keys[i] for i in at]
            pipe = self._clients[s].pipeline(transaction=False)
            for i in range(0, len(ks), _BATCH):
                pipe.delete(*ks[i:i + _BATCH])
            pipe.execute()

    def _scan(self, chunk: int) -> Iterator[tuple]:
        for client in self._clients:
            batch: List[bytes] = []
            for key in client.scan_iter(match=self._prefix + b"*", count=chunk):
                batch.append(key)
                if len(batch) == chunk:
                    yield batch, client.mget(batch)
                    batch = []
            if batch:
                yield batch, client.mget(batch)

    def flush(self) -> None:
        """Nothing to do: durability is the servers' (AOF/RDB) configuration."""

    def close(self) -> None:
        for client in self._clients:
            client.close()
