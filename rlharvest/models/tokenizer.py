"""A character-level tokenizer shipped in code, so nothing is downloaded at run time.

The built-in tasks are arithmetic and short strings; printable ASCII covers them. Ids are stable
across releases because checkpoints and token streams depend on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
_FIRST_CHAR_ID = 3
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII
VOCAB_SIZE = 128  # padded up to a multiple of 64 for matmul-friendly embedding shapes

assert _FIRST_CHAR_ID + len(_CHARS) <= VOCAB_SIZE


class CharTokenizer:
    """Maps text to token ids and back. Unknown characters raise: silent loss would corrupt rewards."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self._to_id = {ch: _FIRST_CHAR_ID + i for i, ch in enumerate(_CHARS)}
        self._to_char = {i: ch for ch, i in self._to_id.items()}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [BOS_ID] if add_bos else []
        for pos, ch in enumerate(text):
            try:
                ids.append(self._to_id[ch])
            except KeyError:
                raise ValueError(
                    f"character {ch!r} at position {pos} is not in the built-in vocabulary "
                    "(newline and printable ASCII only)"
                ) from None
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            ch = self._to_char.get(int(i))
            if ch is not None:
                out.append(ch)
            elif not skip_special:
                out.append(f"<{int(i)}>")
        return "".join(out)

    def decode_batch(self, batch: Sequence[Iterable[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]
