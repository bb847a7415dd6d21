"""Pure parts of the co-executor's OpenAI-compatible API (rlharvest/services/coexecutor/openai_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlharvest.models.hf_checkpoint import build_checkpoint
from rlharvest.models.model_tokenizer import ModelTokenizer, load_tokenizer
from rlharvest.services.coexecutor.openai_api import IncrementalDecoder

# Characters the checkpoint's byte-level BPE spreads over several tokens each.
TEXT = " caf\u00e9 \u2713 \u4f60\u597d \U0001f642 ok"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    path = build_checkpoint(Path(tmp_path_factory.mktemp("ckpt")) / "qwen3", family="qwen3",
                            seed=1)
    return load_tokenizer(str(path))


def test_streamed_pieces_join_to_the_whole_text_and_never_split_a_character(
        bpe: ModelTokenizer) -> None:
    ids = bpe.encode_plain(TEXT)
    assert any("\ufffd" in bpe.decode([t]) for t in ids)  # the text does split characters
    decoder = IncrementalDecoder(bpe)
    pieces = [decoder.add([t]) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == bpe.decode(ids) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_incomplete_character_at_the_end_is_flushed_as_the_whole_decode_has_it(
        bpe: ModelTokenizer) -> None:
    ids = bpe.encode_plain(" \u4f60")
    cut = next(i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith("\ufffd"))
    decoder = IncrementalDecoder(bpe)
    held = "".join(decoder.add([t]) for t in ids[:cut])
    assert held + decoder.flush() == bpe.decode(ids[:cut])


def test_steps_of_several_tokens_decode_like_one_at_a_time(bpe: ModelTokenizer) -> None:
    ids = bpe.encode_plain(TEXT)
    decoder = IncrementalDecoder(bpe)
    pieces = [decoder.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [decoder.flush()]
    assert "".join(pieces) == TEXT
