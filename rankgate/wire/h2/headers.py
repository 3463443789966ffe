"""HPACK (RFC 7541): decoding with a memo for repeated blocks, and literal encoding.

Both roles send only literals that never touch the peer's dynamic table, so encoding needs no
state: a block is built once and reused for every stream that sends it.
"""

from __future__ import annotations

import hpack


class HeaderDecoder:
    """``hpack``'s decoder, with a memo for blocks that leave the dynamic table unchanged.

    While the table is unchanged the same bytes mean the same headers, and a peer answers
    every call with the same few blocks (``:status``/``content-type`` and ``grpc-status: 0``
    once indexed, ``grpc-message`` as a literal that is not indexed); those then cost a dict
    lookup instead of a pure-Python decode. A block that adds to the table or resizes it
    clears the memo, since it changes what the indices mean.
    """

    __slots__ = ("_decoder", "_memo")

    MEMO_SIZE = 64

    def __init__(self, max_header_list_size: int = 64 << 10) -> None:
        self._decoder = hpack.Decoder(max_header_list_size)
        self._memo: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's headers; the list is shared, callers must not change it. Raises
        ``hpack.HPACKError`` for a block that does not decode (text that is not UTF-8 too)."""
        known = self._memo.get(block)
        if known is not None:
            return known
        try:
            headers = [(str(name), str(value)) for name, value in self._decoder.decode(block)]
        except UnicodeDecodeError as error:
            raise hpack.HPACKDecodingError(f"header text is not UTF-8: {error}") from None
        if _keeps_table(block):
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.clear()
            self._memo[block] = headers
        else:
            self._memo.clear()
        return headers


def _keeps_table(block: bytes) -> bool:
    """Whether no field of the block adds to the dynamic table or resizes it: only indexed
    fields and literals without indexing or never indexed (RFC 7541 section 6)."""
    at, size = 0, len(block)
    try:
        while at < size:
            first = block[at]
            if first & 0x80:
                at = _skip_int(block, at, 7)
            elif first & 0x60:
                return False
            else:
                at = _skip_int(block, at, 4)
                if not first & 0x0F:
                    at = _skip_string(block, at)
                at = _skip_string(block, at)
    except IndexError:
        return False
    return at == size


def _skip_int(block: bytes, at: int, prefix_bits: int) -> int:
    limit = (1 << prefix_bits) - 1
    if block[at] & limit != limit:
        return at + 1
    at += 1
    while block[at] & 0x80:
        at += 1
    return at + 1


def _skip_string(block: bytes, at: int) -> int:
    limit = 0x7F
    length = block[at] & limit
    at += 1
    if length == limit:
        shift = 0
        while True:
            byte = block[at]
            at += 1
            length += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
    return at + length


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a ``prefix_bits`` prefix, high bits from ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_str(text: str | bytes) -> bytes:
    """An HPACK string literal, never Huffman-coded (RFC 7541 5.2)."""
    raw = text.encode() if isinstance(text, str) else text
    return hpack_int(len(raw), 7) + raw


def literal(name: str | bytes, value: str | bytes) -> bytes:
    """A literal header field without indexing, new name (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_str(name) + hpack_str(value)
