"""Rows on a Redis Cluster (the ``redis`` package's cluster client).

- A namespace is cut into ``PARTITIONS`` partitions by ``partition_of``; partition
  ``p``'s keys start with the hash tag ``{<namespace>.<pp>}`` (``p`` in two hex
  digits), so they share one slot with the partition's **mark** (tag + ``MARK``) and
  **write count** (tag + ``COUNT``).
- A read, write or delete is one script per partition that checks the mark and the
  count, then reads, or writes and advances the count; a count other than the one
  this store wrote last means acknowledged writes were lost, and the call fails.
- After a call's writes each primary written to is asked to ``WAIT`` for
  ``replicas_to_wait`` replicas (a primary without one is logged once). ``WAIT``
  covers its connection's writes: one connection per node, one thread per store.
"""

import logging
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dynamicemb.kvstore.store import MARK, ExternalStorageError, KVStore, in_chunks

__all__ = ["COUNT", "PARTITIONS", "RedisClusterStore", "partition_of"]

logger = logging.getLogger(__name__)

PARTITIONS = 64  # partitions of a namespace: at most 64 slots, so spread over the primaries
COUNT = b"\x00dynamicemb-writes"  # after a partition's tag: its write count
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_BATCH = 1 << 12  # keys per MGET or script call
_ATTEMPTS = 8  # sends of a command redirected or refused while its slot moves

# KEYS[1] the partition's mark, KEYS[2] its write count, then the rows' keys;
# ARGV[1] this store's mark, ARGV[2] the count it wrote last, then the values.
# Returns the new count, or {mark found or 0, count found} when a check failed.
_CHECK = """
local mark = redis.call('GET', KEYS[1])
local count = redis.call('GET', KEYS[2]) or '0'
if mark ~= ARGV[1] or count ~= ARGV[2] then
  return {mark or 0, count}
end
"""
_CHECKED_MGET = _CHECK + """
return {1, redis.call('MGET', unpack(KEYS, 3, #KEYS))}
"""
_CHECKED_MSET = _CHECK + """
for i = 3, #KEYS, 1000 do
  local args = {}
  for j = i, math.min(i + 999, #KEYS) do
    args[#args + 1] = KEYS[j]
    args[#args + 1] = ARGV[j]
  end
  redis.call('MSET', unpack(args))
end
return redis.call('INCR', KEYS[2])
"""
_CHECKED_DEL = _CHECK + """
for i = 3, #KEYS, 2000 do
  redis.call('DEL', unpack(KEYS, i, math.min(i + 1999, #KEYS)))
end
return redis.call('INCR', KEYS[2])
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


def _moving_errors() -> tuple:
    """Errors of a command that did not run because its slot moves or its node changed role."""
    from redis import exceptions as e
    return (e.AskError, e.TryAgainError, e.ClusterDownError, e.MasterDownError,
            e.ReadOnlyError, e.BusyLoadingError)


_MOVING = _moving_errors()


def partition_of(keys: torch.Tensor, table_ids: torch.Tensor, partitions: int) -> torch.Tensor:
    """(n,) int64 partition of each (key, table id) (n,): ``((key * 0x9E3779B97F4A7C15
    mod 2**64) >> 33 XOR table_id) mod partitions``."""
    mixed = (keys.to(torch.int64) * _GOLDEN) >> 33  # arithmetic shift: keep 31 bits
    return ((mixed & 0x7FFFFFFF) ^ table_ids.to(torch.int64)) % partitions


class RedisClusterStore(KVStore):
    """Rows on a Redis Cluster; arguments as ``RedisStore``'s and ``RedisClusterStorage``'s.

    Args:
        seeds: ``host:port`` of some of the cluster's nodes.
        namespace: prefix of this store's keys (distinct per table group and rank).
    """

    def __init__(self, seeds: Sequence[str], namespace: str, row_width: int, row_format: str,
                 timeout: float = 5.0, resume: bool = False, replicas_to_wait: int = 1,
                 wait_timeout: float = 2.0) -> None:
        super().__init__(f"redis+cluster://{','.join(seeds)}/{namespace}", row_width,
                         row_format)
        if not seeds:
            raise ValueError("RedisClusterStore needs at least one host:port")
        if any(c in namespace for c in ":*?[]{}\\"):
            raise ValueError(f"namespace must not contain any of ':*?[]{{}}\\', got {namespace!r}")
        self.namespace, self.seeds = namespace, tuple(seeds)
        self.replicas_to_wait, self.wait_timeout = int(replicas_to_wait), float(wait_timeout)
        tags = [f"{{{namespace}.{p:02x}}}".encode() for p in range(PARTITIONS)]
        self._tags = np.frombuffer(b"".join(tags), dtype=np.uint8).reshape(PARTITIONS, -1)
        self._marks = [t + MARK for t in tags]
        self._counts_keys = [t + COUNT for t in tags]
        # each partition's write count from us, and how many more a failed call may have added
        self._counts = [0] * PARTITIONS
        self._slack = [0] * PARTITIONS
        self._unreplicated: set = set()  # primaries noted to have no replica
        import redis
        from redis.cluster import ClusterNode, RedisCluster
        self._redis = redis
        try:
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(h, int(p)) for h, p in (s.rsplit(":", 1) for s in seeds)],
                socket_timeout=timeout + self.wait_timeout,  # a WAIT's reply may take both
                socket_connect_timeout=timeout)
        except Exception as e:
            raise ExternalStorageError(
                f"external store {self.name} failed to open: {type(e).__name__}: "
                f"{str(e)[:200]}") from e
        self.claim(resume)

    # ------------------------------------------------------------ layout
    def _key_prefix(self) -> bytes:
        return self._tags[0].tobytes()  # every tag has this length

    def _prefixes(self, keys: torch.Tensor, table_ids: torch.Tensor) -> np.ndarray:
        return self._tags[partition_of(keys, table_ids, PARTITIONS).numpy()]

    def _by_partition(self, keys: List[bytes]) -> Dict[int, np.ndarray]:
        """Positions of ``keys`` per partition (read from their tags)."""
        width = self._tags.shape[1]
        tags = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)[:, :width]
        hexes = tags[:, width - 3:width - 1].copy().view("S2").reshape(-1)
        parts = np.array([int(h, 16) for h in hexes.tolist()], dtype=np.int64) if len(keys) else \
            np.empty(0, dtype=np.int64)
        order = np.argsort(parts, kind="stable")
        found, starts = np.unique(parts[order], return_index=True)
        ends = list(starts[1:]) + [len(order)]
        return {int(p): order[s:e] for p, s, e in zip(found, starts, ends)}

    def _where(self, p: int) -> str:
        node = self._client.get_node_from_key(self._marks[p])
        return f"partition {p} (node {node.name})"

    def _check(self, p: int, mark: Optional[bytes], count: Optional[bytes]) -> None:
        """Raises unless partition ``p`` holds this store's mark and last write count."""
        self._check_mark(self._where(p), mark)
        found = int(count or 0)
        if not self._counts[p] <= found <= self._counts[p] + self._slack[p]:
            raise ExternalStorageError(
                f"external store {self.name}: {self._where(p)} lost writes it had "
                f"acknowledged (its write count is {found}, this store wrote "
                f"{self._counts[p]}): a primary failed before its replica had them. Load "
                f"a checkpoint (DynamicEmbLoad)")
        self._counts[p], self._slack[p] = found, 0

    def _settle(self, partitions) -> None:
        """Reads the counts of the partitions a failed call left uncertain."""
        unsure = [p for p in partitions if self._slack[p]]
        if not unsure:
            return
        replies = self._run([(p, ("MGET", self._marks[p], self._counts_keys[p])) for p in unsure])
        for p, (mark, count) in zip(unsure, replies):
            self._check(p, mark, count)

    # ------------------------------------------------------------- verbs
    def _get(self, keys: List[bytes]) -> Sequence[Optional[bytes]]:
        """One checked ``MGET`` script per partition and ``_BATCH`` keys, one pipeline."""
        groups = self._by_partition(keys)
        self._settle(groups)
        commands, calls = [], []
        for p, at in groups.items():
            for i in range(0, len(at), _BATCH):
                part = at[i:i + _BATCH]
                commands.append((p, ("EVAL", _CHECKED_MGET, 2 + len(part), self._marks[p],
                                     self._counts_keys[p], *[keys[j] for j in part], self.mark,
                                     str(self._counts[p]).encode())))
                calls.append((p, part))
        out: List[Optional[bytes]] = [None] * len(keys)
        for (p, part), reply in zip(calls, self._run(commands)):
            if reply[0] != 1:  # {mark or 0, count}: a check failed
                self._check(p, reply[0] or None, reply[1])
            for j, value in zip(part, reply[1]):
                out[j] = value
        return out

    def _put(self, keys: List[bytes], values: List[bytes]) -> None:
        self._write(_CHECKED_MSET, keys, values)

    def _delete(self, keys: List[bytes]) -> None:
        self._write(_CHECKED_DEL, keys, None)

    def _write(self, script: str, keys: List[bytes], values: Optional[List[bytes]]) -> None:
        """Checked scripts of ``_BATCH`` keys per partition in one pipeline, then ``WAIT``."""
        groups = self._by_partition(keys)
        self._settle(groups)
        commands, calls = [], []
        for p, at in groups.items():
            base = self._counts[p]
            for k, i in enumerate(range(0, len(at), _BATCH)):
                part = at[i:i + _BATCH]
                args = [] if values is None else [values[j] for j in part]
                commands.append((p, ("EVAL", script, 2 + len(part), self._marks[p],
                                     self._counts_keys[p], *[keys[j] for j in part],
                                     self.mark, str(base + k).encode(), *args)))
                calls.append(p)
        try:
            replies = self._run(commands, writes=True)
        except ExternalStorageError:
            for p in calls:  # each call may or may not have run
                self._slack[p] += 1
            raise
        for p, reply in zip(calls, replies):
            if isinstance(reply, list):  # a check failed: nothing of p was written
                self._check(p, reply[0] or None, reply[1])
            self._counts[p] = int(reply)
        self._wait(calls)

    def _wait(self, partitions: List[int]) -> None:
        """``WAIT`` on each primary written to (one known to have no replica: ``ROLE``)."""
        if self.replicas_to_wait <= 0:
            return
        nodes = {n.name: n for n in (self._client.get_node_from_key(self._marks[p])
                                     for p in set(partitions))}
        for name, node in nodes.items():
            if name in self._unreplicated:
                if not self._command("ROLE", target_nodes=node)[2]:
                    continue
                self._unreplicated.discard(name)
            got = self._command("WAIT", self.replicas_to_wait, int(self.wait_timeout * 1000),
                                target_nodes=node)
            if got >= self.replicas_to_wait:
                continue
            if not self._command("ROLE", target_nodes=node)[2]:  # no replica to wait for
                self._unreplicated.add(name)
                logger.warning("external store %s: node %s has no replica: its writes are "
                               "not replicated and a failure of it loses them", self.name, name)
                continue
            raise ExternalStorageError(
                f"external store {self.name}: node {name} wrote the rows but {got} of "
                f"{self.replicas_to_wait} replicas confirmed them within {self.wait_timeout} s "
                f"(replicas_to_wait); a failover could lose them")

    def _command(self, *args, **kwargs):
        try:
            return self._client.execute_command(*args, **kwargs)
        except self._redis.RedisError as e:
            raise ExternalStorageError(f"external store {self.name}: {type(e).__name__}: "
                                       f"{str(e)[:200]}") from e

    def _run(self, commands: List[Tuple[int, tuple]], writes: bool = False) -> list:
        """The replies of ``(partition, command)`` pairs, one pipeline per node. Commands
        redirected or refused while their slot moves are sent again; an unreachable
        node fails the call (after retries for reads; a write may have run)."""
        replies: list = [None] * len(commands)
        todo, asking, error = list(range(len(commands))), {}, None
        for attempt in range(_ATTEMPTS):
            by_node: Dict[str, tuple] = {}
            for i in todo:
                node = asking.get(i) or self._client.get_node_from_key(
                    self._marks[commands[i][0]])
                by_node.setdefault(node.name, (node, []))[1].append(i)
            retry, asking, stale = [], {}, False
            for node, idx in by_node.values():
                try:
                    got = self._pipeline(node, [commands[i][1] for i in idx],
                                         [i in asking for i in idx])
                except (self._redis.ConnectionError, self._redis.TimeoutError) as e:
                    if writes:
                        raise ExternalStorageError(
                            f"external store {self.name}: node {node.name}: "
                            f"{type(e).__name__}: {str(e)[:200]}") from e
                    retry += idx
                    stale, error = True, f"node {node.name}: {type(e).__name__}: {e}"
                    continue
                errors = self._redis.exceptions
                for i, reply in zip(idx, got):
                    if not isinstance(reply, errors.ResponseError):
                        replies[i] = reply
                        continue
                    what = f"node {node.name}: {type(reply).__name__}: {str(reply)[:200]}"
                    if not isinstance(reply, _MOVING):
                        raise ExternalStorageError(f"external store {self.name}: {what}")
                    retry.append(i)
                    error = what
                    if isinstance(reply, errors.AskError) and not isinstance(
                            reply, errors.MovedError):  # this command only, at the target
                        asking[i] = self._client.get_node(host=reply.host, port=reply.port)
                    else:
                        stale |= not isinstance(reply, errors.TryAgainError)
            if not retry:
                return replies
            if stale:
                self._refresh()
            asking = {i: n for i, n in asking.items() if n is not None}
            todo = retry
            time.sleep(min(0.05 * (attempt + 1), 0.5))
        raise ExternalStorageError(f"external store {self.name}: {error} (after "
                                   f"{_ATTEMPTS} attempts)")

    def _pipeline(self, node, commands: List[tuple], asking: List[bool]) -> list:
        """The replies of ``commands`` on ``node``, in one round trip (errors as values)."""
        pipe = node.redis_connection.pipeline(transaction=False)
        for command, ask in zip(commands, asking):
            if ask:
                pipe.execute_command("ASKING")
            pipe.execute_command(*command)
        got = pipe.execute(raise_on_error=False)
        if any(asking):  # drop the ASKING replies
            it = iter(got)
            got = [next(it) if not ask else (next(it), next(it))[1] for ask in asking]
        return got

    def _refresh(self) -> None:
        """Reads the cluster's slot map again (after a failover or a slot moved)."""
        try:
            self._client.nodes_manager.initialize()
        except self._redis.RedisError:
            pass  # the cluster is still settling: the next attempt tries again

    # ---------------------------------------------------------- ownership
    def _read_marks(self) -> List[Tuple[str, Optional[bytes]]]:
        replies = self._run([(p, ("MGET", self._marks[p], self._counts_keys[p]))
                             for p in range(PARTITIONS)])
        self._found_counts = [int(count or 0) for _, count in replies]
        return [(self._where(p), mark) for p, (mark, _) in enumerate(replies)]

    def _write_marks(self, mark: bytes, replace: bool) -> bool:
        took = [reply is not None for reply in self._run(
            [(p, ("SET", self._marks[p], mark) + (() if replace else ("NX",)))
             for p in range(PARTITIONS)], writes=True)]
        if all(took):
            self._counts = list(self._found_counts) if replace else [0] * PARTITIONS
            if not replace:
                self._run([(p, ("SET", self._counts_keys[p], b"0")) for p in range(PARTITIONS)],
                          writes=True)
            self._wait(list(range(PARTITIONS)))
            return True
        self._run([(p, ("EVAL", _RELEASE, 1, self._marks[p], mark))  # another opener won one
                   for p in range(PARTITIONS) if took[p]], writes=True)
        return False

    def _emptying_hint(self) -> str:
        return (f"delete its keys (the pattern '{{{self.namespace}.*') on the cluster of "
                f"{', '.join(self.seeds)}")

    def _scan(self, chunk: int) -> Iterator[tuple]:
        for where, mark in self._read_marks():
            self._check_mark(where, mark)
        keys = self._client.scan_iter(match=b"{" + self.namespace.encode() + b".*", count=chunk,
                                      target_nodes=self._client.PRIMARIES)
        yield from in_chunks(keys, chunk, self._client.mget_nonatomic)

    def close(self) -> None:
        self._client.close()
