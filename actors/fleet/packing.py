"""Heartbeat bodies packed small in memory (:class:`Bodies`): zstd frames against one
raw-content dictionary, the first body packed. What the aggregator's owner keeps of each
node's last heartbeat (``actors.fleet.aggregator.hot_state``) and what a live listing
keeps of each record's own heartbeat until it shows it or a newer one
(``actors.fleet.storage.records.Shelf``).
"""

from __future__ import annotations

import zstandard

PACK_LEVEL = -1
"""zstd's fast level: a 2 KB simulated heartbeat packs to ~150 bytes in ~3 µs and
unpacks in under 1 µs on the 2-core bench machine (level 1 saves 40 bytes more for
twice the time; zlib with the same dictionary takes 10-15 µs)."""
PACK_HASH_LOG = 10
"""log2 of the entries (4 bytes each) of the match table every pack starts afresh: 4 KB,
where the level's own choice for a dictionary of a heartbeat's size is 32 KB. Between two
packs the rest of a heartbeat's work evicts that table from the cache; measured with the
cache disturbed so between packs, an 8-GPU heartbeat packed in 8.4-8.9 µs instead of
11-13 µs, to the same size (a 1-GPU one: the same size too)."""


class Bodies:
    """Heartbeat bodies as kept in memory: zstd frames against one raw-content
    dictionary, the first body this table packs (a heartbeat of this fleet). The
    heartbeats of one fleet share most of their bytes (field names, GPU models, health
    reasons, the agent's version), which the dictionary holds once instead of once per
    node. A first body unlike the rest (a node with no GPU, a hostile but enrolled one)
    only makes the others pack less well (a 1 MB random one: a 4 KB heartbeat keeps 1.9 KB
    and packs in 14.5 µs, not 4.3), never wrongly: every frame unpacks to exactly
    its bytes against the same dictionary."""

    def __init__(self) -> None:
        self._packer = zstandard.ZstdCompressor(level=PACK_LEVEL)
        self._unpacker = zstandard.ZstdDecompressor()
        self._dictionary: zstandard.ZstdCompressionDict | None = None

    def pack(self, body: bytes) -> bytes:
        if self._dictionary is None:
            dictionary = zstandard.ZstdCompressionDict(
                body, dict_type=zstandard.DICT_TYPE_RAWCONTENT
            )
            dictionary.precompute_compress(
                compression_params=zstandard.ZstdCompressionParameters.from_level(
                    PACK_LEVEL, source_size=len(body), dict_size=len(body), hash_log=PACK_HASH_LOG
                )
            )
            self._packer = zstandard.ZstdCompressor(
                level=PACK_LEVEL, dict_data=dictionary, write_checksum=False, write_dict_id=False
            )
            self._unpacker = zstandard.ZstdDecompressor(dict_data=dictionary)
            self._dictionary = dictionary
        # The frame comes in a buffer of zstd's worst-case size (more than the body):
        # kept as it is, it would hold all of that. A copy holds the frame's bytes only.
        return memoryview(self._packer.compress(body)).tobytes()

    def unpack(self, packed: bytes) -> bytes:
        return self._unpacker.decompress(packed)
