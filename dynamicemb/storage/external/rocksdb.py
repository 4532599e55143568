"""An embedded RocksDB store on a local path (the ``rocksdict`` package)."""

import os
from itertools import islice
from typing import Iterator, List, Optional, Sequence

from dynamicemb.storage.external.store import KVStore

__all__ = ["RocksDBStore"]


class RocksDBStore(KVStore):
    """Rows in a RocksDB database of its own directory: nothing to start, it lives
    as long as the directory.

    Args:
        path: the database's directory (created if absent).
        row_width: floats per row.
        sync: make every write durable at once (``WriteOptions.sync``); default off,
            ``flush`` makes them durable.

    Batched verbs: one multi-get per lookup, one ``WriteBatch`` per write.
    """

    def __init__(self, path: str, row_width: int, sync: bool = False) -> None:
        super().__init__(f"rocksdb:{path}", row_width)
        try:
            import rocksdict
        except ImportError as e:  # pragma: no cover - pinned in requirements.txt
            raise ImportError("RocksDBStore needs the rocksdict package "
                              "(pip install rocksdict)") from e
        self._rocksdict = rocksdict
        os.makedirs(path, exist_ok=True)
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        self.path = path
        self._db = rocksdict.Rdict(path, options)
        write = rocksdict.WriteOptions()
        write.sync = sync
        self._db.set_write_options(write)

    def _get(self, keys: List[bytes]) -> Sequence[Optional[bytes]]:
        return self._db.get(keys) if keys else []

    def _write(self, keys: List[bytes], values: Optional[List[bytes]]) -> None:
        batch = self._rocksdict.WriteBatch(raw_mode=True)
        if values is None:
            for key in keys:
                batch.delete(key)
        else:
            for key, value in zip(keys, values):
                batch.put(key, value)
        self._db.write(batch)

    def _put(self, keys: List[bytes], values: List[bytes]) -> None:
        self._write(keys, values)

    def _delete(self, keys: List[bytes]) -> None:
        self._write(keys, None)

    def _scan(self, chunk: int) -> Iterator[tuple]:
        items = self._db.items()
        while True:
            part = list(islice(items, chunk))
            if not part:
                return
            keys, values = zip(*part)
            yield list(keys), list(values)

    def clear(self) -> None:
        """Removes every entry (a range delete over all keys)."""
        self._db.delete_range(b"", b"\xff" * 16)

    def flush(self) -> None:
        self._db.flush()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
