"""Byte-level fallback, tokenizer.json checkpoints, streaming decode, and the generate CLI."""

import dataclasses
import json

import pytest
import torch

import hybrid
from hybrid import ByteTokenizer, HFTokenizer, HybridLM, StreamDecoder, generate, load_tokenizer, recipes
from hybrid.cli import main

TEXT = "héllo wörld, 你好 😀!"


def test_byte_tokenizer_round_trip_and_specials():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert tok.decode([104, tok.eos_token_id, 105]) == "hi"
    assert tok.decode([104, tok.eos_token_id], skip_special_tokens=False) == "h<eos>"
    assert tok.decode([104, 4000]) == "h<unk:4000>"
    assert ByteTokenizer(add_bos=True).encode("a") == [tok.bos_token_id, 97]


def test_stream_decoder_never_emits_half_a_character():
    tok = ByteTokenizer()
    dec = StreamDecoder(tok)
    deltas = [dec.push([b]) for b in tok.encode(TEXT)]
    assert "".join(deltas) + dec.flush() == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # é is two bytes: nothing until both arrived
    assert deltas[-5:-2] == ["", "", ""] and deltas[-2] == "😀"  # a 4-byte emoji, then "!"
    tail = StreamDecoder(tok)
    assert tail.push([0xF0, 0x9F]) == "" and tail.flush() == "\ufffd"  # a cut character shows at the very end


@pytest.fixture
def hf_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, "hello world", "the quick brown fox"] * 10, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}))
    return tmp_path


def test_tokenizer_json_with_special_tokens(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == (1,)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.vocab_size <= 300
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1], "bos_token_id": 0}))
    again = load_tokenizer(hf_dir / "tokenizer.json")
    assert again.eos_token_id == 2 and again.eos_token_ids == (2, 1)
    dec = StreamDecoder(again)
    deltas = [dec.push([i]) for i in again.encode(TEXT)]
    assert "".join(deltas) + dec.flush() == TEXT and all("\ufffd" not in d for d in deltas)


def test_folder_without_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder"):
        load_tokenizer(tmp_path / "missing")


def test_generate_strings_with_a_tokenizer_json_checkpoint(hf_dir):
    torch.manual_seed(0)
    tok = load_tokenizer(hf_dir)
    model = HybridLM(dataclasses.replace(recipes.get("mamba1-tiny"), vocab_size=tok.vocab_size)).eval()
    out = generate(model, ["hello", "the quick"], max_new_tokens=5, tokenizer=tok, ignore_eos=True)
    ids = generate(model, [tok.encode("hello"), tok.encode("the quick")], max_new_tokens=5, ignore_eos=True)
    assert out == [tok.decode(i) for i in ids]


def test_cli_generate_streams_text_and_reports_speed(capsys, tmp_path):
    n = torch.get_num_threads()
    try:
        main(["generate", "--recipe", "samba-tiny", "--prompt", "héllo", "--max-new-tokens", "6", "--threads", "1",
              "--temperature", "0.8", "--seed", "1"])
        first = capsys.readouterr()
        main(["generate", "--recipe", "samba-tiny", "--prompt", "héllo", "--max-new-tokens", "6", "--threads", "1",
              "--temperature", "0.8", "--seed", "1"])
        second = capsys.readouterr()
        torch.manual_seed(0)
        hybrid.save_pretrained(HybridLM(recipes.get("llama-tiny")), tmp_path)
        main(["generate", "--model", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "3", "--threads", "1"])
        third = capsys.readouterr()
    finally:
        torch.set_num_threads(n)
    assert first.out.startswith("héllo") and first.out == second.out
    assert "prefill: 6 tokens" in first.err and "decode: 5 tokens" in first.err and "tok/s" in first.err
    assert third.out.startswith("ab")
    with pytest.raises(SystemExit, match="exactly one of --model DIR or --recipe NAME"):
        main(["generate", "--prompt", "x"])
