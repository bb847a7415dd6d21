"""`rlharvest build-checkpoint` writes a real HF checkpoint: the same files and loaders as a
downloaded Qwen3/Qwen2/Llama directory, and one tokenizer interface reads it (or the built-in
character tokenizer for a preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from rlharvest.models.hf_checkpoint import FAMILIES, app, build_checkpoint
from rlharvest.models.model_tokenizer import TokenizerError, load_tokenizer
from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import EOS_ID

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"}]
TEXT = "Ava has 1,234 apples; -3.5 and \\boxed{42}.\nNext line, caf\u00e9 \u2713"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: str(build_checkpoint(root / family, family=family, seed=1))
            for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_built_checkpoint_has_a_real_checkpoints_files_and_loads_with_transformers(built,
                                                                                      family):
    path = built[family]
    names = {p.name for p in Path(path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] % 64 == 0
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert config["vocab_size"] >= len(tok)
    model = build_model(path)
    again = build_model(path)
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)  # the weights were saved


def test_the_same_seed_builds_the_same_weights_and_another_seed_others(tmp_path):
    first = build_model(str(build_checkpoint(tmp_path / "a", seed=5)))
    second = build_model(str(build_checkpoint(tmp_path / "b", seed=5)))
    third = build_model(str(build_checkpoint(tmp_path / "c", seed=6)))
    name = "model.layers.0.mlp.down_proj.weight"
    weights = [m.state_dict()[name] for m in (first, second, third)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoints_tokenizer_round_trips_text_and_renders_chat_for_a_reply(built, family):
    tok = load_tokenizer(built[family])
    assert tok.decode(tok.encode(TEXT)) == TEXT
    rendered = AutoTokenizer.from_pretrained(built[family]).decode(tok.encode_prompt(CHAT))
    assert "Be brief." in rendered and "What is 6*7?" in rendered
    if family == "llama":
        assert rendered.startswith("<|begin_of_text|>") and rendered.count("<|begin_of_text|>") == 1
        assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert tok.encode("hi")[0] == tok.encode_prompt(CHAT)[0]  # BOS on every encode
    else:
        assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>system" in rendered


@pytest.mark.parametrize("family, stops, pad", [
    ("qwen3", ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>"),
    ("llama", ["<|end_of_text|>", "<|eot_id|>"], "<|end_of_text|>"),  # no pad: the first stop
])
def test_stop_and_pad_ids_come_from_the_checkpoint(built, family, stops, pad):
    tok = load_tokenizer(built[family])
    hf = AutoTokenizer.from_pretrained(built[family])
    assert [hf.convert_ids_to_tokens(i) for i in tok.stop_ids[:2]] == stops
    assert hf.convert_ids_to_tokens(tok.pad_id) == pad
    assert tok.vocab_size == json.loads(open(f"{built[family]}/config.json").read())["vocab_size"]
    assert tok.decode([*tok.encode("7"), *tok.stop_ids]) == "7"  # stops never reach rewards


def test_a_preset_gets_the_builtin_tokenizer_and_a_chat_prompt_is_its_contents():
    tok = load_tokenizer("tiny")
    assert tok.stop_ids == (EOS_ID,) and tok.vocab_size == 128
    assert tok.encode_prompt([{"role": "user", "content": "3+4="}]) == tok.encode("3+4=")
    with pytest.raises(TokenizerError, match="not in the built-in vocabulary"):
        tok.encode("caf\u00e9")


@pytest.mark.parametrize("prompt, message", [
    ([], "at least one message"),
    ([{"role": "user"}], "message 0 has no string 'content'"),
    ([{"role": "user", "content": "a"}, "hi"], "message 1 is str"),
])
def test_malformed_chat_prompts_are_refused_naming_the_message(built, prompt, message):
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(built["qwen3"]).encode_prompt(prompt)


def test_unusable_models_are_refused_with_the_reason(tmp_path):
    with pytest.raises(TokenizerError, match="neither a preset"):
        load_tokenizer(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no usable tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))


def test_building_refuses_a_non_empty_directory_unknown_choices_and_a_tiny_vocabulary(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        build_checkpoint(tmp_path / "taken")
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        build_checkpoint(tmp_path / "g", family="gpt2")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build_checkpoint(tmp_path / "h", size="huge")
    with pytest.raises(ValueError, match="too small"):
        build_checkpoint(tmp_path / "v", vocab_size=100)


def test_the_command_builds_from_a_corpus_file_and_refuses_with_exit_2(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i}: {i * 7} apples" for i in range(200)))
    out = tmp_path / "ck"
    result = CliRunner().invoke(app, ["--out", str(out), "--family", "llama", "--corpus",
                                      str(corpus), "--vocab-size", "300"])
    assert result.exit_code == 0, result.output
    assert "wrote a tiny llama checkpoint" in result.output
    assert load_tokenizer(str(out)).decode(load_tokenizer(str(out)).encode("line 3")) == "line 3"
    again = CliRunner().invoke(app, ["--out", str(out)])
    assert again.exit_code == 2 and "not empty" in again.output


def _old_sharded_checkpoint(out: Path, scratch: Path) -> None:
    """``out`` holds a checkpoint of another seed in three shards with an index, and tokenizer
    files of another kind (a slow BPE's vocab.json and merges.txt)."""
    from transformers import AutoModelForCausalLM

    source = build_checkpoint(scratch, seed=7)
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    shard = sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 3 + 1
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
    (out / "vocab.json").write_text("{}")
    (out / "merges.txt").write_text("#version: 0.2\n")


def test_force_rebuilding_over_a_sharded_checkpoint_leaves_no_file_of_the_old_one(tmp_path):
    from rlharvest.models.decoder_weights import load_decoder

    out = tmp_path / "out"
    _old_sharded_checkpoint(out, tmp_path / "old")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    (out / "README.md").write_text("notes: no part of a checkpoint, kept")
    (out / ".building-x1y2").mkdir()  # a build killed before it finished
    build_checkpoint(out, seed=2, overwrite=True)
    fresh = build_checkpoint(tmp_path / "fresh", seed=2)
    assert {p.name for p in out.iterdir()} == {p.name for p in fresh.iterdir()} | {"README.md"}
    assert (out / "README.md").read_text().startswith("notes")
    rebuilt, expected = load_decoder(str(out)), load_decoder(str(fresh))
    for name, tensor in expected.state_dict().items():  # the new weights, not the old shards'
        assert torch.equal(rebuilt.state_dict()[name], tensor), name


def test_a_force_rebuild_that_fails_leaves_the_old_checkpoint_as_it_was(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    out = build_checkpoint(tmp_path / "out", seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left"):
        build_checkpoint(out, seed=2, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no half-built directory left
