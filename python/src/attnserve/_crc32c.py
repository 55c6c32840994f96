"""CRC-32C (Castagnoli, reflected 0x82F63B78): KvChunk.crc32c (kv_transfer.proto).

google_crc32c's C implementation when it is installed (not a dependency), else a
table in Python: a few MB/s, enough for the chunks a client cuts or checks now and
then; attnserve.transfer.check_chunk_file skips the check on large files without it
(the server checks every chunk it receives either way).
"""

from __future__ import annotations

try:  # pragma: no cover - optional
    import google_crc32c as _fast
except ImportError:  # the pure-Python table below
    _fast = None

_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)

FAST = _fast is not None


def crc32c(data: bytes, crc: int = 0) -> int:
    """Extends `crc` (of the bytes before; 0 for none) over `data`."""
    if _fast is not None:
        return _fast.extend(crc, data)
    c = crc ^ 0xFFFFFFFF
    table = _TABLE
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
