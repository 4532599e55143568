"""The external tier below the host store (``ExternalTier``, ``tier.py``); the stores
live in ``dynamicemb.kvstore`` and their public names are importable from here too."""

from dynamicemb.kvstore import (ExternalStorageError, KVStore, RedisClusterStorage, RedisStorage,
                                RocksDBStorage, StoredRows, as_storage_spec, namespace_of,
                                open_store)

__all__ = ["ExternalStorageError", "KVStore", "RedisClusterStorage", "RedisStorage",
           "RocksDBStorage", "StoredRows",
           "as_storage_spec", "namespace_of", "open_store"]
