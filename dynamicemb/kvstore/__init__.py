"""External key-value stores: the ``KVStore`` interface, the specs
``DynamicEmbTableOptions.external_storage`` takes, and the RocksDB and Redis drivers.
A leaf package: it imports nothing else of ``dynamicemb``.
"""

from dynamicemb.kvstore.spec import (RedisClusterStorage, RedisStorage, RocksDBStorage,
                                     as_storage_spec, namespace_of, open_store)
from dynamicemb.kvstore.store import ExternalStorageError, KVStore, StoredRows

__all__ = ["ExternalStorageError", "KVStore", "RedisClusterStorage", "RedisStorage",
           "RocksDBStorage", "StoredRows",
           "as_storage_spec", "namespace_of", "open_store"]
