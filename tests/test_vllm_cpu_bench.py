"""benchmarks/vllm_cpu.py without vLLM: a stand-in interpreter records the command benchmarks.decode
--vllm-python runs and answers as run_vllm.py does; the export it hands vLLM, the rate it reads back, the cache
of exports, a checkpoint folder handed over as it is, and the refusals."""

import json
import stat
from types import SimpleNamespace

import pytest
import torch

import hybrid
from benchmarks import decode
from benchmarks import vllm_cpu as v
from hybrid import recipes
from hybrid.model import HybridLM

FAKE = """#!/bin/sh
# a stand-in for a vLLM venv's python: `-c "import vllm"` succeeds (or fails when FAIL is set), and
# `run_vllm.py bench EXPORT OUT ...` writes run_vllm.py's result JSON to OUT and records its arguments
if [ "$1" = "-c" ]; then
  [ -z "$FAIL" ] || { echo "ModuleNotFoundError: No module named 'vllm'" >&2; exit 1; }
  exit 0
fi
echo "$@" >> "$(dirname "$0")/calls.txt"
echo "$VLLM_CPU_OMP_THREADS_BIND" >> "$(dirname "$0")/bind.txt"
echo '{"prefill_tok_s": [5.0], "decode_tok_s": [30.0, 10.0, 20.0], "greedy_tokens": [9, 8, 7]}' > "$4"
"""


@pytest.fixture
def fake_python(tmp_path):
    py = tmp_path / "venv" / "python"
    py.parent.mkdir()
    py.write_text(FAKE)
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return py


def _model(name):
    torch.manual_seed(0)
    return HybridLM(recipes.get(name)).eval()


def test_decode_rate_from_the_runner(tmp_path, fake_python):
    v.check_python(str(fake_python))
    row = v.vllm_decode("hybrid-1to7-tiny", _model("hybrid-1to7-tiny"), str(fake_python), tmp_path / "work",
                        batch=32, prompt=16, new_tokens=64, dtype="float32")
    assert (row["tok/s"], row["min"], row["max"], row["format"]) == (20.0, 10.0, 30.0, "granitemoehybrid")
    export = tmp_path / "work" / "hybrid-1to7-tiny" / "export-granitemoehybrid"
    assert json.loads((export / "config.json").read_text())["model_type"] == "granitemoehybrid"
    args = (fake_python.parent / "calls.txt").read_text().split()
    assert args[0].endswith("scripts/serving/run_vllm.py") and args[1:3] == ["bench", str(export)]
    assert args[args.index("--decode") + 1] == "32x64" and args[args.index("--decode-prompt") + 1] == "16"
    assert args[args.index("--dtype") + 1] == "float32"
    assert (fake_python.parent / "bind.txt").read_text().split() == ["0-1"]  # two cores, as ours
    mtime = (export / "config.json").stat().st_mtime_ns
    v.vllm_decode("hybrid-1to7-tiny", _model("hybrid-1to7-tiny"), str(fake_python), tmp_path / "work",
                  batch=8, prompt=16, new_tokens=64, dtype="bfloat16")
    assert (export / "config.json").stat().st_mtime_ns == mtime  # the export is made once


def test_formats_per_family():
    assert v.vllm_format("llama-small") == "llama" and v.vllm_format("mamba2-d512") == "mamba2"
    with pytest.raises(SystemExit, match="no vLLM format known for recipe 'mamba1-tiny'"):
        v.vllm_format("mamba1-tiny")


def test_refusals(tmp_path, fake_python, monkeypatch):
    with pytest.raises(SystemExit, match="no such executable.*check_serving.sh"):
        v.check_python(str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(SystemExit, match="`import vllm` fails there .*No module named 'vllm'"):
        v.check_python(str(fake_python))


def test_a_failed_run_says_where_its_log_is(tmp_path):
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\necho 'RuntimeError: no CPU backend' >&2\nexit 3\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM failed: .*\(log .*\.log\):.*no CPU backend"):
        v.vllm_decode("llama-tiny", _model("llama-tiny"), str(py), tmp_path, batch=4, prompt=16, new_tokens=8,
                      dtype="float32")


def test_a_loop_no_longer_than_its_prefill_is_refused_not_a_rate():
    assert v.decode_seconds(3.0, 1.0) == 2.0
    with pytest.raises(RuntimeError, match="took no longer than its prefill alone .*stalled"):
        v.decode_seconds(1.0, 1.2)


def test_ours_timed_the_way_vllm_is():
    with torch.inference_mode():
        # 16 tokens: the decode steps outlast a busy host's stalls (a loop no longer than its prefill is refused)
        row = v.ours_same_way(_model("llama-tiny"), batch=3, prompt=5, new_tokens=16, repeats=2)
    assert 0 < row["min"] <= row["tok/s"] <= row["max"]


def _llama_folder(tmp_path, tokenizer=True, architecture=None):
    """llama-tiny's seed-0 weights as a Hugging Face Llama folder (what vLLM serves), with a word-level tokenizer
    that knows the greedy prompt's words."""
    folder = tmp_path / "llama-folder"
    hybrid.save_pretrained(_model("llama-tiny"), folder, format="llama")
    if architecture is not None:
        config = json.loads((folder / "config.json").read_text())
        config["architectures"] = architecture
        (folder / "config.json").write_text(json.dumps(config))
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = v.GREEDY_TEXT.split() + ["[UNK]"]
        tok = Tokenizer(models.WordLevel({w: i + 3 for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_checkpoint_folder_goes_to_vllm_as_it_is(tmp_path, fake_python):
    folder = _llama_folder(tmp_path)
    assert v.vllm_format(str(folder)) == "LlamaForCausalLM"
    model = v.bench_model(str(folder))
    assert torch.equal(model.embed.weight, _model("llama-tiny").embed.weight)  # the folder's weights, fp32
    row = v.vllm_decode(str(folder), model, str(fake_python), tmp_path / "work", batch=32, prompt=16,
                        new_tokens=64, dtype="bfloat16")
    assert (row["tok/s"], row["format"]) == (20.0, "LlamaForCausalLM")
    args = (fake_python.parent / "calls.txt").read_text().split()
    assert args[1:3] == ["bench", str(folder)]  # no export: vLLM reads the folder
    assert not list((tmp_path / "work").glob("**/export-*"))
    assert args[args.index("bench") + 2] == str(tmp_path / "work" / "llama-folder" / "vllm-bfloat16-b32-p16-n64.json")
    assert args[args.index("--greedy") + 1] == "3,4,5,6,7"  # the prompt by the folder's own tokenizer
    assert args[args.index("--greedy-tokens") + 1] == str(v.GREEDY_TOKENS)
    assert (row["greedy_prompt"], row["greedy_tokens"]) == ([3, 4, 5, 6, 7], [9, 8, 7])


def test_a_folder_without_tokenizer_is_timed_without_the_greedy_check(tmp_path, fake_python):
    folder = _llama_folder(tmp_path, tokenizer=False)
    row = v.vllm_decode(str(folder), v.bench_model(str(folder)), str(fake_python), tmp_path / "work", batch=4,
                        prompt=16, new_tokens=8, dtype="float32")
    assert "greedy_tokens" not in row and "--greedy" not in (fake_python.parent / "calls.txt").read_text()


def test_folders_vllm_cannot_serve_are_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"is a GPT2LMHeadModel checkpoint, which vLLM is not timed on here; "
                                         r"folders of LlamaForCausalLM, .* are served as they are"):
        v.vllm_format(str(_llama_folder(tmp_path, tokenizer=False, architecture=["GPT2LMHeadModel"])))
    ours = tmp_path / "ours"
    hybrid.save_pretrained(_model("llama-tiny"), ours)  # our own format: config.json without architectures
    with pytest.raises(SystemExit, match=r"names no architecture .*hybrid convert .* OUT --format hf"):
        v.vllm_format(str(ours))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="has no readable config.json"):
        v.vllm_format(str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="no such checkpoint folder"):
        v.vllm_format(str(tmp_path / "missing"))


def test_recipes_stay_recipes():
    assert v.checkpoint_folder("llama-tiny") is None
    assert torch.equal(v.bench_model("llama-tiny").embed.weight, _model("llama-tiny").embed.weight)


def test_agreement():
    assert v.agreement([1, 2, 3], [1, 2, 3]) == "3/3"
    assert v.agreement([1, 2, 3], [1, 5, 3]) == "1/3 (first difference at token 1)"
    assert v.agreement([1, 2], [1, 2, 3]) == "2/3 (first difference at token 2)"


def test_decode_times_a_folder_against_vllm_in_alternating_rounds(tmp_path, fake_python, monkeypatch):
    folder = _llama_folder(tmp_path)
    # our rate as a fixed row: a 3-token loop of a tiny model is milliseconds, which a busy host can stall past its
    # prefill (the benchmark then refuses to give a rate); test_ours_timed_the_way_vllm_is times the real loop
    monkeypatch.setattr(v, "ours_same_way", lambda model, batch, prompt, new_tokens: {"tok/s": 40.0, "min": 39.0,
                                                                                       "max": 41.0})
    args = SimpleNamespace(vllm_python=str(fake_python), quantize=None, recipes=[str(folder)],
                           vllm_dir=str(tmp_path / "work"), vllm_batches=[2], batches=[1], decode_contexts=[4],
                           vllm_rounds=2, vllm_new_tokens=3)
    rows = decode.vllm_runs(args, torch.bfloat16)
    assert [(r["round"], r["batch"], r["format"]) for r in rows] == [(1, 2, "LlamaForCausalLM"),
                                                                   (2, 2, "LlamaForCausalLM")]
    assert len((fake_python.parent / "calls.txt").read_text().splitlines()) == 2  # vLLM once a round
    for r in rows:
        assert r["ours_tok/s"] == 40.0 and r["ours/vllm"] == 2.0  # the fake vLLM's 20 tok/s
        # ours: the engine's greedy continuation of the same prompt ids at the timed dtype
        ref = decode.ours_greedy(v.bench_model(str(folder)).to(torch.bfloat16), [3, 4, 5, 6, 7], v.GREEDY_TOKENS)
        assert r["ours_greedy_tokens"] == ref and len(ref) == v.GREEDY_TOKENS
        assert r["same_greedy"] == v.agreement(ref, [9, 8, 7])


def test_rounds_must_be_at_least_one(tmp_path, fake_python):
    args = SimpleNamespace(vllm_python=str(fake_python), quantize=None, recipes=["llama-tiny"], vllm_dir=str(tmp_path),
                           vllm_batches=[2], batches=[1], decode_contexts=[4], vllm_rounds=0, vllm_new_tokens=3)
    with pytest.raises(SystemExit, match="--vllm-rounds 0: give 1 or more rounds"):
        decode.vllm_runs(args, torch.float32)
