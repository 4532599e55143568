"""The external tier: a store below the host store (the third tier).

``ExternalTier`` (``tier.py``) puts one under a group's host store. The stores
themselves (the ``KVStore`` interface, ``RocksDBStore``, ``RedisStore``) and the specs
``DynamicEmbTableOptions(external_storage=...)`` takes live in the leaf package
``dynamicemb.kvstore``; their public names are importable from here too.
"""

from dynamicemb.kvstore import (ExternalStorageError, KVStore, RedisClusterStorage, RedisStorage,
                                RocksDBStorage, StoredRows, as_storage_spec, namespace_of,
                                open_store)

__all__ = ["ExternalStorageError", "KVStore", "RedisClusterStorage", "RedisStorage",
           "RocksDBStorage", "StoredRows",
           "as_storage_spec", "namespace_of", "open_store"]
