"""An embedded RocksDB store on a local path (the ``rocksdict`` package)."""

import os
from itertools import islice
from typing import Iterator, List, Optional, Sequence, Tuple

from dynamicemb.kvstore.store import MARK, ExternalStorageError, KVStore, brief_error

__all__ = ["RocksDBStore"]


class RocksDBStore(KVStore):
    """Rows in a RocksDB database in directory ``path`` (created if absent, locked while
    open; every verb checks it still holds this database). Arguments as
    ``RocksDBStorage``'s and ``KVStore``'s."""

    def __init__(self, path: str, row_width: int, row_format: str, sync: bool = False,
                 resume: bool = False) -> None:
        super().__init__(f"rocksdb:{path}", row_width, row_format)
        try:
            import rocksdict
        except ImportError as e:  # pragma: no cover - pinned in requirements.txt
            raise ImportError("RocksDBStore needs the rocksdict package "
                              "(pip install rocksdict)") from e
        self._rocksdict = rocksdict
        self.path = path
        self._db = None
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        try:
            os.makedirs(path, exist_ok=True)
            self._db = rocksdict.Rdict(path, options)
        except Exception as e:  # rocksdict raises a bare Exception (e.g. the lock)
            locked = "lock" in str(e).lower()
            raise ExternalStorageError(
                f"external store {self.name} failed to open its directory: "
                + ("another module or process has it open (a directory holds one open "
                   "store at a time: give each module its own path or run name)" if locked
                   else f"{type(e).__name__}: {brief_error(e)}")) from e
        write = rocksdict.WriteOptions()
        write.sync = sync
        self._db.set_write_options(write)
        self._identity = self._identity_now()
        try:
            self.claim(resume)
        except BaseException:
            self.close()  # release the lock
            raise

    def _identity_now(self) -> Optional[Tuple[int, int]]:
        try:
            st = os.stat(os.path.join(self.path, "IDENTITY"))
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _check_directory(self) -> None:
        if self._db is None:
            raise ExternalStorageError(f"external store {self.name} is closed")
        if self._identity is None or self._identity_now() != self._identity:
            raise ExternalStorageError(
                f"external store {self.name}: the directory no longer holds the database "
                f"this module opened (removed or replaced while open): the rows it wrote "
                f"there are lost; the call changed nothing")

    def _get(self, keys: List[bytes]) -> Sequence[Optional[bytes]]:
        self._check_directory()
        return self._db.get(keys) if keys else []

    def _write(self, keys: List[bytes], values: Optional[List[bytes]]) -> None:
        self._check_directory()
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
        self._check_directory()
        items = self._db.items()
        while True:
            part = list(islice(items, chunk))
            if not part:
                return
            keys, values = zip(*part)
            yield list(keys), list(values)

    def _read_marks(self) -> List[Tuple[str, Optional[bytes]]]:
        return [(f"directory {self.path}", self._db.get(MARK))]

    def _write_marks(self, mark: bytes, replace: bool) -> bool:
        # the directory's lock keeps every other opener out: nobody else can write
        if not replace and self._db.get(MARK) is not None:
            return False
        self._db[MARK] = mark
        return True

    def _emptying_hint(self) -> str:
        return f"remove the directory {self.path}"

    def clear(self) -> None:
        """Removes every row (one range delete; the mark is written back)."""
        self._check_directory()
        self._db.delete_range(b"", b"\xff" * 32)
        self._db[MARK] = self.mark

    def flush(self) -> None:
        self._check_directory()
        self._db.flush()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
