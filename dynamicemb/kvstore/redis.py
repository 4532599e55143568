"""Rows on one Redis (or Valkey) server (the ``redis`` package), keys prefixed
``<namespace>:``. A lookup is one pipeline (``GET`` of the mark, then ``MGET``s); a write
or delete one pipeline of Lua scripts that check the mark, then ``MSET``/``DEL``.
"""

import re
from typing import Iterator, List, Optional, Sequence, Tuple

from dynamicemb.kvstore.store import MARK, KVStore, in_chunks

__all__ = ["RedisStore"]

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
# redis-py prefixes a pipeline's error with the command, binary keys and all
_PIPELINE_NOTE = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.S)


class RedisStore(KVStore):
    """Rows on a Redis server, under the key prefix ``namespace`` (per table group and
    rank); other arguments as ``RedisStorage``'s and ``KVStore``'s."""

    def __init__(self, address: str, namespace: str, row_width: int, row_format: str,
                 timeout: float = 5.0, resume: bool = False) -> None:
        super().__init__(f"redis://{address}/{namespace}", row_width, row_format)
        try:
            import redis
        except ImportError as e:  # pragma: no cover - pinned in requirements.txt
            raise ImportError("RedisStore needs the redis package (pip install redis)") from e
        if ":" in namespace or "*" in namespace:
            raise ValueError(f"namespace must not contain ':' or '*', got {namespace!r}")
        self.namespace = namespace
        self.address = address
        self._redis = redis
        self._prefix = namespace.encode() + b":"
        self._mark_key = self._prefix + MARK
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry
        # A lost connection is tried again twice, within about 0.2 s, then the verb fails.
        host, port = address.rsplit(":", 1)
        self._client = redis.Redis(host=host, port=int(port), socket_timeout=timeout,
                                   socket_connect_timeout=timeout,
                                   retry=Retry(ExponentialBackoff(cap=0.1, base=0.05), 2))
        self._where = f"server {address}"
        self.claim(resume)

    def _key_prefix(self) -> bytes:
        return self._prefix

    def _get(self, keys: List[bytes]) -> Sequence[Optional[bytes]]:
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._mark_key)
        for i in range(0, len(keys), _BATCH):
            pipe.mget(keys[i:i + _BATCH])
        mark, *parts = self._execute(pipe)
        self._check_mark(self._where, mark)
        return [v for part in parts for v in part]

    def _put(self, keys: List[bytes], values: List[bytes]) -> None:
        self._checked(_CHECKED_MSET, keys, values)

    def _delete(self, keys: List[bytes]) -> None:
        self._checked(_CHECKED_DEL, keys, [])

    def _checked(self, script: str, keys: List[bytes], values: List[bytes]) -> None:
        """Runs ``script`` over ``keys`` (and ``values``), ``_BATCH`` per call, one pipeline."""
        if not keys:
            return
        pipe = self._client.pipeline(transaction=False)
        for i in range(0, len(keys), _BATCH):
            part = keys[i:i + _BATCH]
            args = part if not values else [
                x for pair in zip(part, values[i:i + _BATCH]) for x in pair]
            pipe.eval(script, 1, self._mark_key, self.mark, *args)
        for reply in self._execute(pipe):
            if reply != 1:  # the first call found it: nothing was written
                self._check_mark(self._where, reply or None)

    def _execute(self, pipe) -> list:
        """``pipe.execute()``, errors without redis-py's quote of the (binary) command."""
        try:
            return pipe.execute()
        except self._redis.RedisError as e:
            if e.args:
                e.args = (_PIPELINE_NOTE.sub("", str(e.args[0])),) + e.args[1:]
            raise

    def _read_marks(self) -> List[Tuple[str, Optional[bytes]]]:
        return [(self._where, self._client.get(self._mark_key))]

    def _write_marks(self, mark: bytes, replace: bool) -> bool:
        return bool(self._client.set(self._mark_key, mark, nx=not replace))

    def _emptying_hint(self) -> str:
        return f"delete its keys (the pattern '{self.namespace}:*') on {self.address}"

    def _scan(self, chunk: int) -> Iterator[tuple]:
        self._check_mark(self._where, self._client.get(self._mark_key))
        yield from in_chunks(self._client.scan_iter(match=self._prefix + b"*", count=chunk),
                             chunk, self._client.mget)

    def flush(self) -> None:
        """Nothing to do: durability is the server's (AOF/RDB) configuration."""

    def close(self) -> None:
        self._client.close()
