"""External stores below the host store (the third tier).

``KVStore`` is the interface (batched verbs over tensors); ``RocksDBStore`` (an
embedded database on a local path) and ``RedisStore`` (one or several Redis
servers) implement it; ``ExternalTier`` puts one under a group's host store.
``DynamicEmbTableOptions(external_storage=...)`` takes a path, a ``redis://`` URL,
a ``RocksDBStorage``/``RedisStorage`` spec or a store (see ``spec``). A store's
namespace belongs to the module that opened it (``KVStore.claim``).
"""

from dynamicemb.storage.external.spec import (RedisStorage, RocksDBStorage, as_storage_spec,
                                              namespace_of, open_store)
from dynamicemb.storage.external.store import ExternalStorageError, KVStore, StoredRows

__all__ = ["ExternalStorageError", "KVStore", "RedisStorage", "RocksDBStorage", "StoredRows",
           "as_storage_spec", "namespace_of", "open_store"]
