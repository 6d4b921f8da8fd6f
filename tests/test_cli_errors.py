"""The mistakes a user makes first at the ``hybrid`` command: each is one line on stderr naming the problem and
the fix, exit code 2, no traceback (``HYBRID_DEBUG=1`` re-raises instead)."""

import json
import subprocess
import sys

import pytest

from hybrid.cli import build_parser, main


def one_line_exit(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,says", [
    (["info", "--recipe", "llama-tyni"], ["unknown recipe 'llama-tyni'", "llama-tiny", "hybrid info --list"]),
    (["generate", "--model", "/tmp/does-not-exist", "--prompt", "x"], ["/tmp/does-not-exist", "folder"]),
    (["generate", "--recipe", "llama-tiny", "--prompt", "x", "--max-new-tokens", "-3"], ["max_new_tokens", "-3"]),
    (["generate", "--recipe", "llama-tiny", "--prompt", "x", "--top-p", "2"], ["top_p must be in (0, 1]"]),
    (["generate", "--recipe", "llama-tiny", "--prompt", "x", "--temperature", "-1"], ["temperature"]),
    (["generate", "--recipe", "llama-tiny", "--prompt", "x", "--chunk", "0"], ["--chunk", ">= 1"]),
    (["generate", "--recipe", "llama-tyni", "--prompt", "x"], ["unknown recipe"]),
    (["serve", "--recipe", "llama-tiny", "--cache-bytes", "lots"], ["not a size"]),
    (["info", "--recipe", "llama-tiny", "--kv-dtype", "int3"], ["--kv-dtype", "invalid choice"]),
    (["info"], ["give --recipe NAME"]),
    (["eval", "--recipe", "llama-tiny", "--model", "x"], ["exactly one of"]),
])
def test_mistakes_are_one_line(capsys, argv, says):
    err = one_line_exit(capsys, argv)
    assert all(s in err for s in says), err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_and_absent(capsys):
    for argv in (["info", "--recipe", "llama-tiny", "--device", "cuda"],
                 ["generate", "--recipe", "llama-tiny", "--prompt", "x", "--device", "cuda:0"]):
        err = one_line_exit(capsys, argv)
        assert "--device" in err and "CUDA" in err and "--device cpu" in err


def test_checkpoint_config_and_pattern_errors(capsys, tmp_path):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    err = one_line_exit(capsys, ["info", "--model", str(tmp_path / "foreign")])
    assert "NoSuchForCausalLM" in err
    (tmp_path / "ours").mkdir()
    bad_pattern = {"format": "hybrid-lm", "pattern": "*Q-", "vocab_size": 16, "d_model": 8}
    (tmp_path / "ours" / "config.json").write_text(json.dumps(bad_pattern))
    (tmp_path / "ours" / "model.safetensors").write_bytes(b"")
    err = one_line_exit(capsys, ["info", "--model", str(tmp_path / "ours")])
    assert "Q" in err  # PatternError
    (tmp_path / "ours" / "config.json").write_text(json.dumps({"format": "hybrid-lm", "pattern": "*-"}))
    err = one_line_exit(capsys, ["info", "--model", str(tmp_path / "ours")])
    assert "vocab_size" in err and "d_model" in err  # ConfigError


def test_a_missing_extra_names_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if not installed
    err = one_line_exit(capsys, ["eval", "--recipe", "llama-tiny"])
    assert "lm_eval" in err and "pip install 'hybrid-lm[eval]'" in err
    for name in [m for m in sys.modules if m == "hybrid.server" or m.startswith("hybrid.server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    err = one_line_exit(capsys, ["serve", "--recipe", "llama-tiny"])
    assert "fastapi" in err and "hybrid-lm[serve]" in err


def test_the_real_process_exits_2_without_a_traceback_and_debug_re_raises():
    cmd = [sys.executable, "-m", "hybrid.cli", "info", "--recipe", "llama-tyni"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "HYBRID_DEBUG": "1"})
    assert out.returncode == 1 and "Traceback" in out.stderr


def test_every_option_has_help_and_there_is_a_version(capsys):
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help, f"hybrid {name} {action.option_strings or action.dest} has no help text"
        assert "(default: " in sub.format_help() or name == "doctor"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hybrid-lm 0.")
