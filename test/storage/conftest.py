"""Fixtures of the external-store tests: each kind of store, on a fresh place."""

import pytest

from dynamicemb.storage.external import RedisStorage, RocksDBStorage
from dynamicemb_testing.redis_servers import REDIS_SERVER, RedisServer

STORE_KINDS = ["rocksdb", "redis"]


@pytest.fixture
def redis_servers(tmp_path):
    """``redis_servers(n, **kw)`` -> n running ``RedisServer``s, stopped at teardown."""
    started = []

    def start(n: int = 1, **kw):
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        for _ in range(n):
            d = tmp_path / f"redis{len(started)}"
            d.mkdir()
            started.append(RedisServer(str(d), **kw))
        return started[-n:]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(params=STORE_KINDS)
def store_spec(request, tmp_path, redis_servers):
    """A storage spec of each kind: RocksDB in a temp dir, a Redis server (a Redis
    Cluster: test_redis_cluster.py)."""
    if request.param == "rocksdb":
        return RocksDBStorage(str(tmp_path / "rocks"))
    (server,) = redis_servers(1)
    return RedisStorage(server.address, timeout=2.0)
