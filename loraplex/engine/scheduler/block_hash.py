"""Content keys of full KV blocks: a hash chain over (parent key, the block's token ids, adapter version).

The K/V of a block depends on every token before it (through attention), on its own tokens and their
positions, and on the weights that computed it: the base model (one per engine) and the request's LoRA
plan, its *owner* (``KVOwner``): None for the base model, an adapter *version* id for that adapter at
scale 1 (a runtime reload gets a new id, so its blocks get new keys; a name is never part of a key), or
the whole plan, every ``(version id, scale)`` entry in order, for a scaled adapter or a mix.
Block ``i``'s key digests block ``i-1``'s key (positions and the whole prefix), its ``block_size`` token
ids and the version, so two blocks share a key only if everything their K/V depends on is equal.

The encoding is canonical (fixed-width fields, the token count in front of the tokens, a tag that
tells the base model from every adapter id) and the digest is SHA-256, so keys cannot be made to
collide by choosing prompts (unlike a fast non-cryptographic hash of the tokens).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

from loraplex.engine.request import KVOwner

ROOT = bytes(32)  # the parent key of a sequence's first block
_BASE = b"\x00" + bytes(8)  # the base model; adapter versions are b"\x01" + their id, plans b"\x02" + entries


def owner_members(owner: KVOwner) -> tuple[int, ...]:
    """The adapter version ids ``owner`` reads."""
    if owner is None:
        return ()
    return (owner,) if isinstance(owner, int) else tuple(v for v, _ in owner)


def version_tag(owner: KVOwner) -> bytes:
    """The canonical encoding of an owner: 9 bytes for the base model or an adapter version, and for a plan
    ``0x02 | count (4 bytes) | (version id int64, scale float64)`` per entry, so no plan's tag equals
    another owner's (the same prompt under scale 0.5 and 1.0 never shares a key)."""
    if owner is None:
        return _BASE
    if isinstance(owner, int):
        return b"\x01" + owner.to_bytes(8, "little", signed=True)
    return b"\x02" + len(owner).to_bytes(4, "little") + b"".join(struct.pack("<qd", v, s) for v, s in owner)


def block_key(parent: bytes, token_ids: Sequence[int], version_id: KVOwner) -> bytes:
    """The 32-byte key of one full block: SHA-256 of ``parent | version | len | tokens (int64)``."""
    tokens = array("q", token_ids)
    if tokens.itemsize != 8:
        raise RuntimeError("array('q') is not 64-bit on this platform")
    h = hashlib.sha256(parent)
    h.update(version_tag(version_id))
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    return h.digest()


def extend_chain(keys: list[bytes], token_ids: Sequence[int], version_id: KVOwner, block_size: int,
                 base_blocks: int = 0) -> list[bytes]:
    """Append to ``keys`` (the keys of ``token_ids``' first ``len(keys)`` blocks) the keys of its
    remaining full blocks; returns ``keys``. A partial last block has no key. The first ``base_blocks`` blocks
    key as the base model's (an aLoRA request's blocks before its invocation point: their K/V are the base's)."""
    for i in range(len(keys), len(token_ids) // block_size):
        parent = keys[i - 1] if i else ROOT
        owner = None if i < base_blocks else version_id
        keys.append(block_key(parent, token_ids[i * block_size:(i + 1) * block_size], owner))
    return keys
