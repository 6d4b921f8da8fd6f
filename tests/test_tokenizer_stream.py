"""Streaming detokenisation through ``tokenizers.decoders.DecodeStream``: what streams out equals the full
decode, for byte-level BPE (an emoji's four bytes as four tokens), a sentencepiece-style byte-fallback
vocabulary (``<0xF0>`` pieces, a decoder that strips the first space), special tokens skipped or kept,
ids pushed one at a time or in chunks (a fork), and a stream whose DecodeStream fails half-way."""

from __future__ import annotations

import json

import pytest

from hybrid import ByteTokenizer, StreamDecoder, load_tokenizer

TEXT = "héllo wörld, 你好 😀! the 🤖 says hi"


def byte_level_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox"] * 10, trainer)  # no merges inside emoji
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return tmp_path


def byte_fallback_dir(tmp_path):
    """Llama-2's layout: a small piece vocabulary, <0xNN> tokens for every byte of anything else."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "a", "y", "s", "i", ",", "!", "▁the", "▁hi", "llo"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return tmp_path


@pytest.fixture(params=["byte_level", "byte_fallback"])
def tok(request, tmp_path):
    return load_tokenizer({"byte_level": byte_level_dir, "byte_fallback": byte_fallback_dir}[request.param](tmp_path))


def stream(tok, ids, skip=True, chunk=1):
    dec = StreamDecoder(tok, skip_special_tokens=skip)
    deltas = [dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return dec, deltas, dec.flush()


def test_the_tokenizers_backend_streams_through_decode_stream(tok):
    from tokenizers.decoders import DecodeStream

    assert isinstance(StreamDecoder(tok).stream, DecodeStream)
    assert StreamDecoder(ByteTokenizer()).stream is None  # no tokenizers backend: our window method


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_the_full_decode(tok, chunk):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) >= 4  # the emoji is split across tokens (a byte each)
    dec, deltas, tail = stream(tok, ids, chunk=chunk)
    assert "".join(deltas) + tail == TEXT == dec.text and tail == ""
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas or chunk > 1  # one token at a time: the emoji arrives whole, in one delta
    so_far = ""
    for d in deltas:  # every moment of the stream is a prefix of the final text
        so_far += d
        assert TEXT.startswith(so_far)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept_as_the_full_decode(tok, skip):
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids = [bos, *tok.encode("hi 😀", add_special_tokens=False), eos, *tok.encode(" the", add_special_tokens=False),
           eos]
    full = tok.decode(ids, skip_special_tokens=skip)
    assert ("</s>" in full) is not skip
    dec, deltas, tail = stream(tok, ids, skip=skip)
    assert "".join(deltas) + tail == full


def test_a_character_cut_by_the_end_shows_at_flush_as_in_a_full_decode(tok):
    ids = tok.encode("ab😀", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    dec, deltas, tail = stream(tok, ids)
    assert "".join(deltas) == "ab" and tail and set(tail) == {"\ufffd"}
    full = tok.decode(ids)  # byte-level: "ab" + one U+FFFD; byte fallback garbles the whole byte run "b..."
    assert full == "ab" + tail or full.startswith("a\ufffd")


def test_a_fork_pushes_its_whole_output_at_once(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    dec = StreamDecoder(tok)
    first = dec.push(ids[:7])
    rest = [dec.push([i]) for i in ids[7:]]
    assert first + "".join(rest) + dec.flush() == TEXT


def test_a_decode_stream_error_falls_back_to_full_decodes(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    dec = StreamDecoder(tok)
    real, steps = dec.stream, []

    class Failing:
        def step(self, backend, i):
            steps.append(i)
            if len(steps) > 9:
                raise Exception("DecodeStream: invalid prefix")
            return real.step(backend, i)
    dec.stream = Failing()
    deltas = [dec.push([i]) for i in ids]
    assert dec.stream is None and len(steps) == 10
    assert "".join(deltas) + dec.flush() == TEXT and all("\ufffd" not in d for d in deltas)
