"""Rows on one or several Redis (or Valkey) servers (the ``redis`` package).

Keys are spread over the servers by ``server_of``: the upper bits of the key times
the 64-bit golden-ratio constant, XOR the table id, modulo the number of servers.
Every lookup is one pipeline per server: a ``GET`` of the namespace's mark (see
``store``), then ``MGET``s; every write or delete one pipeline of Lua scripts
(``EVAL``) that check the mark and only then ``MSET``/``DEL``, so a server that lost
its data, or a namespace another module took over, is written nothing. Values are
binary. Several ranks and tables share a server set through namespaces: every key
starts with ``<namespace>:``.
"""

import re
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from dynamicemb.kvstore.store import MARK, KVStore, unpack_keys

__all__ = ["RedisStore", "server_of"]

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_BATCH = 1 << 14  # keys per MGET command or script call inside a pipeline

# KEYS[1]: the mark, ARGV[1]: this store's, then the keys (and values, interleaved:
# MSET's arguments); a script returns 1 when it wrote, else the mark it found (0:
# none). Lua's unpack takes at most ~8000 values: 2000 a command.
_CHECK = """
local mark = redis.call('GET', KEYS[1])
if mark ~= ARGV[1] then
  if mark then return mark end
  return 0
end
"""
_CHECKED_MSET = _CHECK + """
for i = 2, #ARGV, 2000 do
  redis.call('MSET', unpack(ARGV, i, math.min(i + 1999, #ARGV)))
end
return 1
"""
_CHECKED_DEL = _CHECK + """
for i = 2, #ARGV, 2000 do
  redis.call('DEL', unpack(ARGV, i, math.min(i + 1999, #ARGV)))
end
return 1
"""
_RELEASE = _CHECK + """
redis.call('DEL', KEYS[1])
return 1
"""
# redis-py prefixes a pipeline's error with the command, binary keys and all
_PIPELINE_NOTE = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.S)


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
        resume: take over the rows an earlier module left in the namespace (see
            ``KVStore.claim``); else a namespace holding them is refused.
    """

    def __init__(self, addresses: Sequence[str], namespace: str, row_width: int,
                 timeout: float = 5.0, resume: bool = False) -> None:
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
        self.addresses = tuple(addresses)
        self._redis = redis
        self._prefix = namespace.encode() + b":"
        self._mark_key = self._prefix + MARK
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry
        # A lost connection is tried again twice, within about 0.2 s, then the verb fails.
        self._clients = [
            redis.Redis(host=host, port=int(port), socket_timeout=timeout,
                        socket_connect_timeout=timeout,
                        retry=Retry(ExponentialBackoff(cap=0.1, base=0.05), 2))
            for host, port in (a.rsplit(":", 1) for a in addresses)
        ]
        self.claim(resume)

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
            pipe.get(self._mark_key)
            for i in range(0, len(mine), _BATCH):
                pipe.mget(mine[i:i + _BATCH])
            mark, *parts = self._execute(pipe)
            self._check_mark(f"server {self.addresses[s]}", mark)
            got = [v for part in parts for v in part]
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
            self._checked(s, _CHECKED_MSET, ks, vs)

    def _delete(self, keys: List[bytes]) -> None:
        for s, at in self._spread(keys):
            ks = keys if len(at) == len(keys) else [keys[i] for i in at]
            self._checked(s, _CHECKED_DEL, ks, [])

    def _checked(self, s: int, script: str, keys: List[bytes], values: List[bytes]) -> None:
        """Runs ``script`` on server ``s`` over ``keys`` (and ``values``) in calls of
        ``_BATCH`` keys, one pipeline; each call writes only under this store's mark."""
        if not keys:
            return
        pipe = self._clients[s].pipeline(transaction=False)
        for i in range(0, len(keys), _BATCH):
            part = keys[i:i + _BATCH]
            args = part if not values else [
                x for pair in zip(part, values[i:i + _BATCH]) for x in pair]
            pipe.eval(script, 1, self._mark_key, self.mark, *args)
        for reply in self._execute(pipe):
            if reply != 1:  # the first call found it: nothing was written
                self._check_mark(f"server {self.addresses[s]}", reply or None)

    def _execute(self, pipe) -> list:
        """``pipe.execute()``, a failure's message without redis-py's quote of the
        command (binary keys)."""
        try:
            return pipe.execute()
        except self._redis.RedisError as e:
            if e.args:
                e.args = (_PIPELINE_NOTE.sub("", str(e.args[0])),) + e.args[1:]
            raise

    def _read_marks(self) -> List[Tuple[str, Optional[bytes]]]:
        return [(f"server {a}", c.get(self._mark_key))
                for a, c in zip(self.addresses, self._clients)]

    def _write_marks(self, mark: bytes, replace: bool) -> bool:
        took = [bool(c.set(self._mark_key, mark, nx=not replace)) for c in self._clients]
        if all(took):
            return True
        for client, mine in zip(self._clients, took):  # another opener won a server
            if mine:
                client.eval(_RELEASE, 1, self._mark_key, mark)
        return False

    def _emptying_hint(self) -> str:
        return (f"delete its keys (the pattern '{self.namespace}:*') on "
                f"{', '.join(self.addresses)}")

    def _scan(self, chunk: int) -> Iterator[tuple]:
        for address, client in zip(self.addresses, self._clients):
            self._check_mark(f"server {address}", client.get(self._mark_key))
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
