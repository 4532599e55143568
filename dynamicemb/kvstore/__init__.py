"""External key-value stores: the interface, the specs the option takes, the drivers.

``KVStore`` is the interface (batched verbs over tensors); ``RocksDBStore`` (an
embedded database on a local path), ``RedisStore`` (one or several Redis
servers) and ``RedisClusterStore`` (a Redis Cluster) implement it.
``DynamicEmbTableOptions(external_storage=...)`` takes a path, a ``redis://`` or
``redis+cluster://`` URL, a ``RocksDBStorage``/``RedisStorage``/``RedisClusterStorage`` spec or a store
(see ``spec``). A store's namespace belongs to the module that opened it
(``KVStore.claim``).

A leaf package: it imports nothing else of ``dynamicemb``, so the options (at the
bottom of the layers) can check a spec and the storage layer can put a store under
a host store (``dynamicemb.storage.external.ExternalTier``).
"""

from dynamicemb.kvstore.spec import (RedisClusterStorage, RedisStorage, RocksDBStorage,
                                     as_storage_spec, namespace_of, open_store)
from dynamicemb.kvstore.store import ExternalStorageError, KVStore, StoredRows

__all__ = ["ExternalStorageError", "KVStore", "RedisClusterStorage", "RedisStorage",
           "RocksDBStorage", "StoredRows",
           "as_storage_spec", "namespace_of", "open_store"]
