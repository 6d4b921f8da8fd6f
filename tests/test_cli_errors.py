"""The mistakes a user makes first at the ``hybrid`` command: each is one line on stderr naming the problem and
the fix, exit code 2, no traceback (``HYBRID_DEBUG=1`` re-raises instead)."""

import json
import subprocess
import sys

import pytest
from cli_helpers import one_line_exit

from hybrid.cli import build_parser, main


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


NO_CUDA = not __import__("torch").cuda.is_available()
TINY = ["--recipe", "llama-tiny"]
# every sub-command of `hybrid --help` with bad values: (argv, environment, fragments the one line must hold).
# A new sub-command must add its own cases here (test_every_subcommand_is_walked).
BAD = {
    "info": [(["info", *TINY, "--seq-len", "0"], {}, ["--seq-len", ">= 1"]),
             (["info", *TINY], {"HYBRID_NATIVE": "maybe"}, ["HYBRID_NATIVE", "1 or 0"]),
             (["info", *TINY], {"HYBRID_BACKEND": "fast"}, ["HYBRID_BACKEND", "not a kernel backend"]),
             (["info", "--bogus"], {}, ["unrecognized arguments: --bogus"])],
    "bench": [(["bench", *TINY, "--threads", "-3"], {}, ["--threads", ">= 0"]),
              (["bench", *TINY, "--lengths", "0"], {}, ["--lengths", ">= 1"]),
              (["bench", *TINY, "--repeats", "0"], {}, ["--repeats"]),
              (["bench", *TINY, "--max-spread", "-1"], {}, ["--max-spread", "> 0"]),
              (["bench", *TINY, "--warmup", "x"], {}, ["--warmup", "not an integer"])],
    "eval": [(["eval", *TINY, "--num-fewshot", "-1"], {}, ["--num-fewshot", ">= 0"]),
             (["eval", *TINY, "--limit", "0"], {}, ["--limit", "> 0"]),
             (["eval", *TINY, "--batch-size", "0"], {}, ["--batch-size"]),
             (["eval", "--model", "/nonexistent/ckpt"], {}, ["/nonexistent/ckpt", "no such folder"]),
             (["eval", *TINY, "--backend", "fast"], {}, ["--backend", "invalid choice"])],
    "tradeoff": [(["tradeoff", "--threads", "-3"], {}, ["--threads", ">= 0"]),
                 (["tradeoff", "--lengths", "0"], {}, ["--lengths", ">= 1"]),
                 (["tradeoff", "--teacher", "/tmp/does-not-exist"], {}, ["/tmp/does-not-exist"]),
                 (["tradeoff", "--mixer", "lstm"], {}, ["--mixer", "invalid choice"]),
                 (["tradeoff"], {"HYBRID_HUGE_PAGES": "lots"}, ["HYBRID_HUGE_PAGES"])],
    "convert": [(["convert", "/nonexistent/src", "/tmp/never-written"], {}, ["/nonexistent/src", "not a directory"]),
                (["convert", "a", "b", "--dtype", "int8"], {}, ["--dtype", "invalid choice"])],
    "generate": [(["generate", *TINY, "--prompt", "x", "--threads", "-3"], {}, ["--threads", ">= 0"]),
                 (["generate", *TINY, "--prompt", "x", "--ngram", "--num-draft-tokens", "0"], {},
                  ["--num-draft-tokens", ">= 1"]),
                 (["generate", *TINY, "--prompt", "x"], {"HYBRID_BACKEND": "fast"}, ["HYBRID_BACKEND"]),
                 (["generate", *TINY], {}, ["--prompt"]),
                 (["generate", *TINY, "--prompt", "x", "--max-batch-tokens", "0"], {}, ["--max-batch-tokens", ">= 1"]),
                 (["generate", *TINY, "--prompt", "x", "--multi-step", "0"], {}, ["--multi-step", ">= 1"]),
                 (["generate", *TINY, "--prompt", "x", "--kv-pruning", "h2o"], {}, ["--kv-pruning", "h2o"])],
    "serve": [(["serve", *TINY, "--threads", "-3"], {}, ["--threads", ">= 0"]),
              (["serve", *TINY, "--port", "-1"], {}, ["--port", "0-65535"]),
              (["serve", *TINY, "--shutdown-timeout", "-1"], {}, ["--shutdown-timeout", ">= 0"]),
              (["serve", *TINY, "--max-seqs", "0"], {}, ["--max-seqs", ">= 1"]),
              (["serve", *TINY, "--max-batch-tokens", "0"], {}, ["--max-batch-tokens", ">= 1"]),
              (["serve", *TINY, "--max-model-len", "8", "--max-prompt-tokens", "8"], {},
               ["--max-prompt-tokens 8 leaves no room", "--max-model-len 8"]),
              (["serve", *TINY, "--kv-pruning", "snapkv:budget=64", "--prefix-caching"], {},
               ["kv_pruning with prefix_caching is not supported"]),
              (["serve", *TINY], {"HYBRID_KEEP_FREED_MEMORY": "sometimes"}, ["HYBRID_KEEP_FREED_MEMORY"])],
    "chat": [(["chat", *TINY, "--threads", "-3"], {}, ["--threads", ">= 0"]),
             (["chat", *TINY, "--max-context", "0"], {}, ["--max-context"]),
             (["chat", *TINY, "--max-new-tokens", "300", "--max-context", "256"], {}, ["--max-context"]),
             (["chat", *TINY, "--top-p", "2"], {}, ["top_p must be in (0, 1]"]),
             (["chat", *TINY, "--multi-step", "0"], {}, ["--multi-step", ">= 1"])],
    "distill": [(["distill", "/tmp/does-not-exist", "--share", "0.5", "--out", "/tmp/x", "--no-peak"], {},
                 ["/tmp/does-not-exist"]),
                (["distill", "/tmp/does-not-exist", "--share", "0.5", "--out", "/tmp/x", "--align-tokens", "-1"], {},
                 ["--align-tokens", ">= 0"]),
                (["distill", "/tmp/does-not-exist", "--share", "0.5", "--out", "/tmp/x", "--seq-len", "0"], {},
                 ["--seq-len"])],
    "doctor": [(["doctor"], {"HYBRID_BACKEND": "fast"}, ["HYBRID_BACKEND", "not a kernel backend"]),
               (["doctor"], {"HYBRID_NATIVE_SPIN_US": "abc"}, ["HYBRID_NATIVE_SPIN_US", "microseconds"])],
}
if NO_CUDA:  # the device a CPU machine lacks, asked for by flag and by variable
    BAD["info"].append((["info", *TINY], {"HYBRID_BACKEND": "cuda"}, ["HYBRID_BACKEND=cuda", "no CUDA"]))
    BAD["generate"].append((["generate", *TINY, "--prompt", "x"], {"HYBRID_BACKEND": "cuda"},
                            ["HYBRID_BACKEND=cuda", "cannot run", "leave it out"]))
    BAD["eval"].append((["eval", *TINY, "--backend", "cuda"], {}, ["--backend=cuda", "no CUDA", "leave it out"]))
    BAD["bench"].append((["bench", *TINY, "--device", "cuda"], {}, ["--device", "--device cpu"]))


def test_every_subcommand_is_walked():
    subs = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert set(subs) == set(BAD), f"sub-commands without bad-value cases: {sorted(set(subs) - set(BAD))}"


@pytest.mark.parametrize("argv,env,says", [c for cases in BAD.values() for c in cases],
                         ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] in BAD else None)
def test_each_subcommand_refuses_bad_values_in_one_line(capsys, monkeypatch, argv, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    err = one_line_exit(capsys, argv)
    assert err.startswith("hybrid") and all(s in err for s in says), err


def test_a_forced_backend_that_can_run_here_passes(capsys, monkeypatch):
    monkeypatch.setenv("HYBRID_BACKEND", "torch")
    main(["info", *TINY])
    assert "llama-tiny" in capsys.readouterr().out
    monkeypatch.setenv("HYBRID_BACKEND", "cuda")  # doctor reports why a backend cannot run instead of refusing
    main(["doctor"])
    assert "HYBRID_BACKEND=cuda" in capsys.readouterr().out


def test_a_folder_without_a_tokenizer_is_said_once(capsys, tmp_path):
    import hybrid

    cfg = hybrid.HybridConfig(vocab_size=512, d_model=32, pattern="*-",
                              attention=hybrid.AttentionConfig(n_heads=2, n_kv_heads=1))
    hybrid.save_pretrained(hybrid.HybridLM(cfg), tmp_path / "m")
    main(["generate", "--model", str(tmp_path / "m"), "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert err.count("has no tokenizer.json") == 1 and "<unk:ID>" in err and str(tmp_path / "m") in err, err


@pytest.mark.skipif(not NO_CUDA, reason="the note is for a CPU run")
def test_compile_on_a_cpu_is_ignored_with_a_note(capsys):
    main(["generate", *TINY, "--prompt", "hi", "--max-new-tokens", "3", "--compile"])
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "--compile" in line]
    assert len(notes) == 1 and "ignored on a CPU" in notes[0], err
    assert "compile:" not in err and "torch._dynamo" not in out + err  # nothing compiled, no dynamo output


def test_many_models_show_progress(capsys):
    main(["info", "--recipe", "llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny"])
    out, err = capsys.readouterr()
    assert "building models" in err and "0/3" in err and "building models" not in out
