"""``EngineConfig``: one validated value for every engine setting, a JSON round trip, the CLI flags defined once,
and every place in the library, eval and the benchmarks building its engine through it."""

import ast
import json
from pathlib import Path

import pytest
import torch

from hybrid import Engine, EngineConfig, HybridLM, SpeculativeConfig, recipes
from hybrid.cache.pruning import SnapKV, StreamingLLM
from hybrid.cli import build_parser
from hybrid.cli.engine_args import FLAGS, engine_config
from hybrid.cli.errors import CLIError

ROOT = Path(__file__).resolve().parents[1]


def tiny():
    torch.manual_seed(0)
    return HybridLM(recipes.get("llama-tiny")).eval()


@pytest.mark.parametrize("fields,says", [
    ({"max_seqs": 0}, "max_seqs=0: must be an int >= 1"),
    ({"max_batch_tokens": 2.5}, "max_batch_tokens=2.5: must be an int >= 1"),
    ({"block_size": True}, "block_size=True: must be an int >= 1"),
    ({"multi_step": 0}, "multi_step=0: must be an int >= 1 (1: one decode step"),
    ({"num_blocks": -1}, "num_blocks=-1: must be an int >= 0"),
    ({"cache_bytes": 0}, "cache_bytes=0: must be an int >= 1 or None"),
    ({"num_blocks": 4, "cache_bytes": 2**20}, "exactly one of num_blocks= or cache_bytes="),
    ({"long_prefill_tokens": 0}, "long_prefill_tokens=0"),
    ({"max_model_len": 1}, "max_model_len=1: must be an int >= 2 (a prompt token and a generated one)"),
    ({"max_model_len": 8, "max_prompt_tokens": 8}, "max_prompt_tokens=8 leaves no room to generate within "
                                                   "max_model_len=8"),
    ({"kv_dtype": "int3"}, "kv_dtype 'int3' is not supported; choose one of"),
    ({"state_dtype": "fp8"}, "state_dtype 'fp8' is not supported"),
    ({"kv_pruning": "h2o:budget=4"}, "kv_pruning='h2o:budget=4': unknown KV pruning policy"),
    ({"kv_pruning": SnapKV(budget=64), "prefix_caching": True}, "kv_pruning with prefix_caching is not supported"),
    ({"prefix_state_bytes": 2**20}, "prefix_state_bytes / prefix_checkpoint_interval need prefix_caching=True"),
    ({"prefix_caching": True, "prefix_checkpoint_interval": 0}, "prefix_checkpoint_interval=0"),
    ({"prefix_flop_weight": float("inf")}, "prefix_flop_weight=inf: must be a finite number >= 0"),
    ({"compile": "yes"}, "compile='yes': must be True or False"),
    ({"compile_backend": ""}, "compile_backend='': must be a torch.compile backend name"),
])
def test_a_bad_value_is_one_line_naming_the_field_and_what_is_allowed(fields, says):
    with pytest.raises(ValueError) as e:
        EngineConfig(**fields)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_wrong_kinds_of_objects_are_type_errors_and_unknown_names_are_listed():
    with pytest.raises(TypeError, match="kv_pruning=5: must be a StreamingLLM or SnapKV"):
        EngineConfig(kv_pruning=5)
    with pytest.raises(TypeError, match="speculative='ngram': must be a hybrid.speculative.SpeculativeConfig"):
        EngineConfig(speculative="ngram")
    with pytest.raises(TypeError):  # keyword-only: no positional settings to swap by mistake
        EngineConfig(16)
    with pytest.raises(ValueError, match="no engine setting named 'max_seq'; the settings are .*max_seqs"):
        EngineConfig().replace(max_seq=4)
    with pytest.raises(ValueError, match="no engine setting named 'max_seq'"):
        Engine(tiny(), EngineConfig(), max_seq=4)
    with pytest.raises(ValueError, match="config must be a hybrid.EngineConfig, got dict"):
        Engine(tiny(), {"max_seqs": 4})


def test_names_become_canonical_and_text_becomes_a_policy():
    c = EngineConfig(kv_dtype=torch.bfloat16, state_dtype="bf16", kv_pruning="streaming:sinks=2,window=30")
    assert (c.kv_dtype, c.state_dtype) == ("bfloat16", "bfloat16")
    assert c.kv_pruning == StreamingLLM(sinks=2, window=30)
    assert EngineConfig(kv_dtype="fp8_e4m3").kv_dtype == "fp8"
    with pytest.raises(AttributeError):  # frozen: a config is shared, never changed in place
        c.max_seqs = 3


@pytest.mark.parametrize("config", [
    EngineConfig(),
    EngineConfig(max_seqs=3, max_batch_tokens=64, long_prefill_tokens=32, multi_step=4, num_blocks=40, block_size=8,
                 kv_dtype="int8", state_dtype="bfloat16", stochastic_state=True, compile=True,
                 compile_backend="aot_eager", max_model_len=100, max_prompt_tokens=90),
    EngineConfig(cache_bytes=2**24, prefix_caching=True, prefix_state_bytes=2**20, prefix_checkpoint_interval=64,
                 prefix_flop_weight=0.0, speculative=SpeculativeConfig(method="ngram", num_tokens=3, ngram_max=4)),
    EngineConfig(kv_pruning=SnapKV(budget=64, window=8, pooling="avg")),
    EngineConfig(kv_pruning=StreamingLLM(sinks=2, window=30, renumber=False)),
])
def test_json_round_trip_gives_the_same_config(config):
    text = json.dumps(config.to_dict())
    assert EngineConfig.from_dict(json.loads(text)) == config


def test_a_draft_model_is_named_in_json_and_given_back_to_from_dict():
    draft = tiny()
    config = EngineConfig(speculative=SpeculativeConfig(method="draft", draft_model=draft, num_tokens=2))
    data = json.loads(json.dumps(config.to_dict()))
    assert data["speculative"]["draft_model"] == "HybridLM"
    with pytest.raises(ValueError, match="draft model .HybridLM., which JSON does not carry: pass it as "
                                         "from_dict\\(..., draft_model=MODEL\\)"):
        EngineConfig.from_dict(data)
    assert EngineConfig.from_dict(data, draft_model=draft) == config
    with pytest.raises(ValueError, match="no engine setting named 'max_seq'"):
        EngineConfig.from_dict({"max_seq": 3})


def test_the_engine_takes_a_config_or_keywords_and_runs_it():
    model = tiny()
    config = EngineConfig(num_blocks=6, block_size=4, max_seqs=2, max_batch_tokens=8, multi_step=2)
    engine = Engine(model, config)
    assert engine.config == config and engine.max_seqs == 2 and engine.max_batch_tokens == 8
    assert engine.cache.kv.num_blocks == 6 and engine.multi_step == 2
    assert Engine(model, num_blocks=6, block_size=4, max_seqs=2, max_batch_tokens=8, multi_step=2).config == config
    changed = Engine(model, config, max_seqs=1)  # a keyword changes one field of the given config
    assert changed.config == config.replace(max_seqs=1) and changed.max_seqs == 1
    assert Engine(model).config == EngineConfig()
    # the length limits set later are recorded as asked for, so engine.config rebuilds the same engine
    engine.set_length_limits(12, 10)
    assert (engine.config.max_model_len, engine.config.max_prompt_tokens) == (12, 10)
    again = Engine(model, EngineConfig.from_dict(json.loads(json.dumps(engine.config.to_dict()))))
    assert (again.max_model_len, again.max_prompt_tokens) == (12, 10)


def _engine_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Engine":
            yield node


def test_every_call_site_builds_its_engine_through_an_engine_config():
    """Engine(model, config, cache=..., tokenizer=...) everywhere in the library, eval and the benchmarks: the
    keyword settings stay a convenience for users, not 17 arguments mapped by hand at each call site."""
    files = [f for d in ("hybrid", "eval", "benchmarks") for f in (ROOT / d).rglob("*.py")]
    calls = [(f, c) for f in files for c in _engine_calls(f)]
    assert len(calls) >= 12, "the call sites were not found: did they move?"
    for f, call in calls:
        where = f"{f.relative_to(ROOT)}:{call.lineno}"
        keywords = {k.arg for k in call.keywords}
        assert keywords <= {"cache", "tokenizer", "config"} and len(call.args) <= 2, (
            f"{where} maps engine settings by hand ({sorted(keywords - {'cache', 'tokenizer', 'config'})}): build an "
            "EngineConfig (in the CLI: hybrid.cli.engine_args.engine_config)")


def test_each_flag_lands_in_its_field():
    p = build_parser()
    args = p.parse_args(["serve", "--recipe", "llama-tiny", "--cache-bytes", "64MiB", "--max-seqs", "3",
                         "--max-batch-tokens", "48", "--long-prefill-tokens", "32", "--max-model-len", "200",
                         "--max-prompt-tokens", "150", "--compile", "--multi-step", "2", "--kv-dtype", "int8",
                         "--state-dtype", "bfloat16", "--kv-pruning", "streaming:sinks=2,window=30", "--ngram",
                         "--num-draft-tokens", "3"])
    c = engine_config(args, tiny())
    assert c == EngineConfig(cache_bytes=64 * 2**20, max_seqs=3, max_batch_tokens=48, long_prefill_tokens=32,
                             max_model_len=200, max_prompt_tokens=150, compile=True, multi_step=2, kv_dtype="int8",
                             state_dtype="bfloat16", kv_pruning=StreamingLLM(sinks=2, window=30),
                             speculative=SpeculativeConfig(method="ngram", num_tokens=3))
    # every engine flag is offered by serve; the sub-commands' own defaults stay theirs
    assert {a.dest for a in p._subparsers._group_actions[0].choices["serve"]._actions} >= set(FLAGS) - {"speculative"}
    generate = p.parse_args(["generate", "--recipe", "llama-tiny", "--prompt", "x", "--chunk", "64"])
    assert (generate.max_batch_tokens, generate.multi_step) == (64, 4)  # --chunk: the older name
    assert EngineConfig.from_args(generate, max_seqs=1).max_batch_tokens == 64


def test_a_value_the_config_refuses_names_the_flag():
    args = build_parser().parse_args(["serve", "--recipe", "llama-tiny", "--max-model-len", "8",
                                      "--max-prompt-tokens", "8"])
    with pytest.raises(CLIError, match="--max-prompt-tokens 8 leaves no room to generate within --max-model-len 8"):
        engine_config(args, tiny())
    args = build_parser().parse_args(["serve", "--recipe", "llama-tiny", "--kv-pruning", "snapkv:budget=64",
                                      "--prefix-caching"])
    with pytest.raises(CLIError, match="kv_pruning with prefix_caching is not supported"):
        engine_config(args, tiny())
    with pytest.raises(TypeError, match="the speculative flags need the target model"):
        engine_config(args)  # serve offers --ngram: without the model it would be dropped


def test_a_bench_record_stores_the_exact_engine(tmp_path):
    from hybrid.cli import main

    out = tmp_path / "bench.json"
    main(["bench", "--recipe", "llama-tiny", "--lengths", "8", "--repeats", "1", "--warmup", "0", "--no-peak",
          "--decode-tokens", "2", "--decode-ctx", "8", "--kv-dtype", "int8", "--output", str(out)])
    stored = json.loads(out.read_text())["engine_configs"]["llama-tiny"]
    config = EngineConfig.from_dict(stored)
    assert config.kv_dtype == "int8" and config.max_seqs == 1 and config.to_dict() == stored
