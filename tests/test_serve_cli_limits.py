"""``hybrid serve``'s length flags: impossible limits are one line naming the flag (before any server starts), the
checkpoint's context length is read from its config.json, and the banner's counts are plain integers."""

import json

import pytest
from cli_helpers import one_line_exit

from hybrid.cli.serve import model_context, plain


@pytest.mark.parametrize("extra,says", [
    (["--max-model-len", "100000000"], ["--max-model-len 100000000", "more than the KV cache holds", "--cache-bytes"]),
    (["--max-model-len", "100", "--max-prompt-tokens", "100"], ["--max-prompt-tokens 100", "leaves no room",
                                                               "<= 99"]),
    (["--max-prompt-tokens", "0"], ["--max-prompt-tokens", ">= 1"]),
    (["--long-prefill-tokens", "-4"], ["--long-prefill-tokens", ">= 1"]),
])
def test_impossible_limits_are_one_line(capsys, extra, says):
    err = one_line_exit(capsys, ["serve", "--recipe", "hybrid-1to7-tiny", "--cache-bytes", "4MiB", *extra])
    assert all(s in err for s in says), err


def test_model_context_reads_max_position_embeddings(tmp_path):
    assert model_context(None) is None
    assert model_context(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert model_context(str(tmp_path)) == 8192
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 64}))
    assert model_context(str(tmp_path)) is None


def test_banner_counts_are_plain():
    assert plain(1030580.0) == "1030580" and plain(None) == "unbounded" and plain(float("inf")) == "unbounded"
