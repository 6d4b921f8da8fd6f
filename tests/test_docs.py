"""The manual builds (``mkdocs build --strict``: a broken link or a stale API reference fails), its results
pages are what their JSON records give, and the README stays a front door."""

import subprocess
import sys
from pathlib import Path

from benchmarks import render_results

REPO = Path(__file__).resolve().parents[1]


def test_results_pages_are_generated_from_the_records():
    pages = render_results.render()
    assert {"index.md", "prefill.md", "compression.md", "tradeoff.md"} <= set(pages)
    for name, text in pages.items():
        path = REPO / "docs" / "results" / name
        assert path.exists() and path.read_text() == text, f"{path} is stale: python -m benchmarks.render_results"
    records = render_results.load(REPO / "docs" / "results" / "data")
    assert all(r["date"] and r["machine"] and r["command"] for r in records)
    assert sum(len(r["rows"]) for r in records) > 200  # the measurement tables moved out of the README


def test_a_record_naming_an_unknown_page_is_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"title": "t", "page": "nowhere", "date": "d", "machine": "m", '
                                     '"command": "c", "rows": []}')
    try:
        render_results.load(tmp_path)
    except ValueError as e:
        assert "nowhere" in str(e) and "prefill" in str(e)
    else:
        raise AssertionError("an unknown page was accepted")


def test_mkdocs_builds_strict(tmp_path):
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("HybridLM") > 1


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "bash scripts/run.sh" in readme and "bash scripts/test.sh" in readme


# ---- every example in the README and the manual runs as written, from the installed wheel ------------------------
# Each page's python blocks run as one script (later blocks use earlier ones' names) and its bash commands one by
# one, in a work folder where the placeholders the examples name are bound to tiny stand-ins (STAND_INS), with the
# wheel's `hybrid` first on PATH and nothing downloaded. What cannot run here is skipped by an explicit rule
# (SKIP_RULES: the first pattern a block or command matches, with the reason), never silently.
import re  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
from test_eval_mmlu_local import ROWS, write_csv  # noqa: E402
from test_wheel import run  # noqa: E402

PAGES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")
                               if not {"results", "notes"} & set(p.relative_to(REPO / "docs").parts))
# records of measurement runs (docs/results, generated) and lab notes (docs/notes) quote the commands that made
# them (benchmarks of minutes to hours); they are not examples and are not run
SKIP_RULES = [
    (r"^(pip|uv) install|^pip install", "installs packages (network)"),
    (r"^bash scripts/", "the main job / the whole suite (minutes to hours); CI runs them directly"),
    (r"^vllm\b|vllm", "needs vLLM"),
    (r"^hybrid serve\b|^lm_eval .*local-completions|^hybrid-lm-eval .*local-completions|^curl ",
     "starts or needs a running server (tests/test_server*.py cover it)"),
    (r"openai\.OpenAI|base_url=", "needs a running server"),
    (r"^hybrid tradeoff\b", "trains and times a model family (~10 min on 2 cores; scripts/run.sh runs it)"),
    (r"^flock ", "a benchmark under the shared lock (minutes)"),
    (r"^hybrid bench .*-small|all-small", "builds or times the 50-100M-parameter small models: minutes on 2 cores"),
    (r"--lengths [^#]*\b(8192|16384|32768|65536)\b", "prefill of 8K+ tokens: minutes on 2 cores"),
    (r"^python -m benchmarks\b|^mkdocs |^pip install -e \"\.\[docs\]\"",
     "runs from a source checkout (benchmarks/ is not installed); test_mkdocs_builds_strict builds the manual"),
    (r"cuda|--device cuda|\.cuda\(\)", "needs a CUDA GPU"),
    (r"TRITON_INTERPRET|--backend triton|use_backend\(\"triton\"\)", "Triton's interpreter: tests only"),
    (r"--draft-model", "speculative decoding between random-weight stand-ins: 60-70 s a command here"),
    (r"^from \.", "a module of the package (a converter's file), not a script"),
    (r"llama\.cpp|llama-bench|llama-server", "needs llama.cpp"),
    (r"smollm2-135m-instruct|pretrained_path", "the real model by name: ~20 s to load per example; "
                                               "tests/test_chat.py and test_pretrained_names.py run these paths"),
    (r"\.gguf\b", "needs a GGUF file: tests/test_interop_gguf.py writes tiny ones and loads them the same ways"),
    (r"^hybrid distill\b", "distils a teacher (minutes); tests/test_distill_cli.py runs it on a tiny teacher"),
    (r"family/students/", "a student the (skipped) hybrid distill command above makes; tests/test_distill_student.py "
                          "runs students through the engine"),
]
# examples known not to run as written, skipped with what is wrong (reported in the test's output, never silent);
# fixing the page means taking its entry off this list
PENDING = {
    ("docs/kernels.md", "kernels.varlen_attention(q, k, v"): "a fragment: q, k, v, cu_seqlens are defined nowhere",
    ("docs/serving.md", "client."): "needs a running server (the client of the block above)",
    ("docs/cache/prefix.md", "context"): "a fragment: context is defined nowhere on the page",
    ("docs/cache/speculative.md", "target"): "a fragment: target is defined nowhere on the page",
    ("docs/decode.md", 'hybrid.quantize(model, "8da4w")'): "two alternatives in one block: the second quantises the "
                                                            "model the first already quantised",
}
# the names the manual's fragments take as given (`hybrid` imported, a `model`, a tokenizer `tok`)
PRELUDE = """import torch, hybrid
model = hybrid.HybridLM(hybrid.recipes.get("hybrid-1to7-tiny"))
tok = hybrid.load_tokenizer(None)
"""
VOCAB = 32000  # the README's Build example's vocabulary: every stand-in shares it, so --draft-model pairs any two

STAND_INS = f"""
import sys, torch, hybrid, transformers
torch.manual_seed(0)
def ours(path):
    cfg = hybrid.HybridConfig(vocab_size={VOCAB}, d_model=64, pattern="M-*-",
                              attention=hybrid.AttentionConfig(n_heads=4, n_kv_heads=2))
    hybrid.save_pretrained(hybrid.HybridLM(cfg), path)
for path in ("ckpt", "ckpt/a", "ckpt/b", "DIR", "SRC", "draft", "draft_dir", "checkpoint"):
    ours(path)
llama = transformers.LlamaConfig(vocab_size={VOCAB}, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)
transformers.LlamaForCausalLM(llama).save_pretrained("Llama-3.2-1B")
jamba = transformers.JambaConfig(vocab_size=120, hidden_size=32, intermediate_size=40, mamba_d_state=8,
                                 mamba_d_conv=4, mamba_expand=2, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                                 pad_token_id=0)
transformers.JambaForCausalLM(jamba).save_pretrained("path/to/jamba")
"""


def blocks(page: str) -> list[tuple[str, str]]:
    """The page's fenced ``python`` and ``bash`` blocks, in order, as (language, text)."""
    text = (REPO / page).read_text()
    return [(lang, body) for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
            if lang in ("python", "bash")]


def commands(body: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _code(text: str) -> str:
    """What runs: the text less its trailing comments (two spaces and a #), which pages word differently."""
    return "\n".join(line.split("  #")[0].rstrip() for line in text.strip().splitlines())


def skip_reason(text: str) -> str | None:
    code = _code(text)  # a comment's words are not the command
    for pattern, reason in SKIP_RULES:
        if re.search(pattern, code, re.M):
            return reason
    return None


@pytest.fixture(scope="module")
def workdir(installed, tmp_path_factory):
    env_dir, env, outside = installed
    work = tmp_path_factory.mktemp("examples")
    (work / "path" / "to").mkdir(parents=True)
    subjects = sorted(p.stem.removeprefix("mmlu_local_") for p in (REPO / "eval" / "tasks").glob("mmlu_local_*.yaml"))
    for subject in subjects:  # every subject (mmlu_local's groups need them all): 5 dev rows for --num-fewshot 5, and
        write_csv(work / "path" / "to" / "mmlu", subject, (ROWS * 3)[:5], test_rows=ROWS[:1])  # one question
    out = run([str(env_dir / "bin" / "python"), "-c", STAND_INS], env, work)
    assert out.returncode == 0, out.stderr[-3000:]
    env = {**env, "PATH": f"{env_dir / 'bin'}:{env['PATH']}", "HYBRID_MMLU_DIR": str(work / "path" / "to" / "mmlu")}
    return env_dir, env, work


def _first_pages() -> dict[tuple[str, str], str]:
    """Each example that runs, keyed by (language, text), to the first page (in PAGES order) where it does."""
    first = {}
    for page in PAGES:
        for lang, body in blocks(page):
            for text in [body] if lang == "python" else commands(body):
                if not (skip_reason(text) or pending(page, text)):
                    first.setdefault((lang, _code(text)), page)
    return first


def runs_elsewhere(page: str, lang: str, text: str) -> str | None:
    """Why an example is not run again here: the same code runs as written on an earlier page (the manual repeats
    the README's command overview and its lm-eval example), or None."""
    first = FIRST_PAGES.get((lang, _code(text)), page)
    return None if first == page else f"runs as written on {first}"


def pending(page: str, text: str) -> str | None:
    """The reason an example is known not to run as written (PENDING), or None."""
    return next((why for (p, snippet), why in PENDING.items() if p == page and snippet in text), None)


FIRST_PAGES = _first_pages()


@pytest.mark.slow  # ~3-7 min on 2 busy cores: -m "not slow" leaves it out
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.xdist_group(f"docs:{p}"))  # one worker each
                                  for p in PAGES if blocks(p)])
def test_examples_run_as_written(workdir, page):
    """The page's python blocks first, each in its own process after PRELUDE (they make the folders the commands
    use: the README's Build saves ckpt), then its bash commands in order. A command whose comment says it is
    refused must fail as the CLI fails: exit 2, one line, no traceback."""
    env_dir, env, work = workdir
    ran, skipped, failures, timings = 0, [], [], []
    for lang, body in blocks(page):
        if lang != "python":
            continue
        why = skip_reason(body) or pending(page, body) or runs_elsewhere(page, "python", body)
        if why:
            skipped.append((body.strip().splitlines()[0], why))
            continue
        t0 = time.perf_counter()
        out = run([str(env_dir / "bin" / "python"), "-c", PRELUDE + body], env, work)
        timings.append(f"{time.perf_counter() - t0:.1f}s {body.strip().splitlines()[0][:40]}")
        ran += 1
        shown = re.search(r"^# (\w+Error): (.{20})", body, re.M)  # a block that shows the error it raises
        if shown and (out.returncode == 0 or f"{shown[1]}: {shown[2]}" not in out.stderr):
            failures.append(f"{page}, python block should raise {shown[1]}: {shown[2]}...:\n{out.stderr[-2000:]}")
        elif not shown and out.returncode != 0:
            failures.append(f"{page}, python block:\n{body}\n{out.stderr[-2000:]}")
    for lang, body in blocks(page):
        for cmd in commands(body) if lang == "bash" else ():
            why = skip_reason(cmd) or pending(page, cmd) or runs_elsewhere(page, "bash", cmd)
            if why:
                skipped.append((cmd, why))
                continue
            t0 = time.perf_counter()
            out = subprocess.run(cmd, shell=True, env=env, cwd=work, capture_output=True, text=True, timeout=120)
            timings.append(f"{time.perf_counter() - t0:.1f}s {cmd[:50]}")
            ran += 1
            refused = "# refused" in cmd
            if refused and (out.returncode != 2 or len(out.stderr.strip().splitlines()) != 1):
                failures.append(f"$ {cmd}\nshould be refused in one line, got exit {out.returncode}:\n"
                                f"{out.stderr[-1500:]}")
            elif not refused and out.returncode != 0:
                failures.append(f"$ {cmd}\n{out.stderr[-1500:]}")
    print(f"{page}: {ran} run ({'; '.join(timings)}), {len(skipped)} skipped: "
          + "; ".join(f"{shlex.quote(c)[:60]} ({w})" for c, w in skipped))
    assert not failures, "\n\n".join(failures)
    assert ran or skipped
