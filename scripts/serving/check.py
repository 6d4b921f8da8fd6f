"""Export one small model per family, run greedy continuations through our engine, vLLM and llama.cpp,
and print one table: family x engine -> loads / serves / tokens identical / first divergence.
Called by scripts/check_serving.sh (which installs the engines); runs in our .venv.

    python scripts/serving/check.py --work DIR --vllm-python PY --llama-cpp DIR [--families ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from families import ENGINES, FAMILIES, build
from tqdm import tqdm

import hybrid
from hybrid import CheckpointError

HERE = Path(__file__).resolve().parent
PROMPT_LENGTHS = (5, 40, 200)
N_NEW = 16
ENGINE_TIMEOUT_S = 1200


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def locked(cmd: list[str]) -> list[str]:
    """Engine runs are measurements of a shared machine: one at a time (flock), as every benchmark here."""
    return ["flock", "/tmp/bench.lock", *cmd]


def run(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        try:
            # vLLM logs (and its engine core's traceback) go to stdout: keep them with stderr
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=ENGINE_TIMEOUT_S,
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {ENGINE_TIMEOUT_S} s")


def tail_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or "exception" in ln.lower()]
    return (errs or lines or ["(no output)"])[-1][:300]


def root_cause(log: Path) -> str | None:
    """The last exception line ("SomethingError: ...") vLLM's engine core logged."""
    import re
    hits = [m.group(0) for m in re.finditer(r"\b[A-Z]\w*(Error|Exception): [^\n]*", log.read_text(errors="replace"))
            if "EngineDeadError" not in m.group(0)]
    return hits[-1][:300] if hits else None


def first_divergence(ours: list[list[int]], theirs: list[list[int]]) -> str | None:
    for p, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        for t, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f"prompt of {PROMPT_LENGTHS[p]} ids, token {t}: ours {x}, theirs {y}"
        if len(a) != len(b):
            return f"prompt of {PROMPT_LENGTHS[p]} ids: {len(b)} tokens instead of {len(a)}"
    return None


def vllm_row(args, export_dir: Path, spec: Path, flags: list[str], work: Path) -> dict:
    out, log = work / f"vllm{''.join(flags)}.json", work / f"vllm{''.join(flags)}.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind, "VLLM_CPU_KVCACHE_SPACE": "1"}
    run(locked([args.vllm_python, str(HERE / "run_vllm.py"), "tokens", str(export_dir), str(spec), str(out),
                *flags]), log, env)
    if not out.is_file():
        return {"loads": False, "serves": False, "tokens": None, "error": tail_error(log)}
    res = json.loads(out.read_text())
    if res.get("error") and "EngineDeadError" in res["error"]:  # the root cause is in the engine core's log
        res["error"] = root_cause(log) or res["error"]
    return res


def llama_cpp_row(args, export_dir: Path, ids: list[list[int]], work: Path, outtype: str = "f32") -> dict:
    """Convert ``export_dir`` to ``work/model-{outtype}.gguf`` with llama.cpp's converter and run the greedy
    continuations of ``ids`` through libllama on it."""
    gguf = work / f"model-{outtype}.gguf"
    conv = run([sys.executable, str(HERE / "gguf_convert.py"), str(args.llama_cpp), str(export_dir), str(gguf),
                "--outtype", outtype], work / f"convert-{outtype}.log")
    if conv.returncode != 0 or not gguf.is_file():
        return {"loads": False, "serves": False, "tokens": None,
                "error": "convert_hf_to_gguf: " + tail_error(work / f"convert-{outtype}.log")}
    (work / "prompts.txt").write_text("\n".join(" ".join(map(str, p)) for p in ids) + "\n")
    with open(work / "prompts.txt") as stdin, open(work / "llama.log", "w") as err:
        try:
            res = subprocess.run(locked([str(args.llama_greedy), str(gguf), str(N_NEW)]), stdin=stdin,
                                 stdout=subprocess.PIPE, stderr=err, text=True, timeout=ENGINE_TIMEOUT_S,
                                 env={**os.environ, "OMP_NUM_THREADS": "2"})
        except subprocess.TimeoutExpired:
            return {"loads": True, "serves": False, "tokens": None, "error": "timed out"}
    log_text = (work / "llama.log").read_text(errors="replace")
    loads = "could not load" not in log_text
    if res.returncode != 0:
        return {"loads": loads, "serves": False, "tokens": None, "error": tail_error(work / "llama.log")}
    tokens = [[int(x) for x in line.split()] for line in res.stdout.strip().splitlines()]
    return {"loads": True, "serves": True, "tokens": tokens, "error": None}


def check_family(args, fam, root: Path) -> list[dict]:
    work = root / fam.name
    work.mkdir(parents=True, exist_ok=True)
    model = build(fam)
    ids = prompts(fam.config.vocab_size)
    ours = {"float32": hybrid.generate(model, ids, max_new_tokens=N_NEW, ignore_eos=True)}
    spec = work / "prompts.json"
    spec.write_text(json.dumps({"prompts": ids, "n_new": N_NEW, "max_model_len": max(PROMPT_LENGTHS) + N_NEW + 8}))
    rows = []
    for engine in args.engines:
        fmt = fam.formats[engine]
        export_dir = work / f"export-{fmt}"
        base = {"family": fam.name, "what": fam.what, "engine": engine, "format": fmt}
        try:
            hybrid.save_pretrained(model, export_dir, format=fmt)
        except CheckpointError as e:
            rows.append({**base, "loads": False, "serves": False, "tokens": None,
                         "error": f"not exported: {str(e).splitlines()[0][:200]}"})
            continue
        if fmt == "hf":
            base["format"] = json.loads((export_dir / "config.json").read_text())["architectures"][0]
        for flags in (fam.variants.get(engine) or [[]]):
            edir = work / f"{engine}{''.join(flags)}"
            edir.mkdir(exist_ok=True)
            res = vllm_row(args, export_dir, spec, flags, edir) if engine == "vllm" else \
                llama_cpp_row(args, export_dir, ids, edir)
            row = {**base, "flags": " ".join(flags), **{k: res.get(k) for k in ("loads", "serves", "error")}}
            # an engine run in bf16 (``--dtype bfloat16``) is held to our model in bf16
            dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else "float32"
            if dtype not in ours:
                ours[dtype] = hybrid.generate(copy.deepcopy(model).to(getattr(torch, dtype)), ids,
                                              max_new_tokens=N_NEW, ignore_eos=True)
            row["identical"] = res.get("tokens") == ours[dtype] if res.get("serves") else None
            row["divergence"] = first_divergence(ours[dtype], res["tokens"]) if res.get("serves") else None
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def yn(v):
        return "—" if v is None else ("yes" if v else "**no**")

    out = ["| family | export | engine | loads | serves | tokens identical | first divergence / error |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        engine = r["engine"] + (f" ({r['flags']})" if r.get("flags") else "")
        note = r.get("divergence") or r.get("error") or ""
        out.append(f"| {r['family']} | `{r['format']}` | {engine} | {yn(r['loads'])} | {yn(r['serves'])} | "
                   f"{yn(r.get('identical'))} | {note.replace('|', '/')} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--vllm-threads-bind", default="0-1")
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--llama-greedy", type=Path, required=True)
    ap.add_argument("--families", nargs="*", default=[f.name for f in FAMILIES],
                    help=f"subset of {[f.name for f in FAMILIES]}")
    ap.add_argument("--engines", nargs="*", default=list(ENGINES), choices=ENGINES)
    args = ap.parse_args()
    torch.set_num_threads(2)
    unknown = set(args.families) - {f.name for f in FAMILIES}
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; known: {[f.name for f in FAMILIES]}")
    rows = []
    for fam in tqdm([f for f in FAMILIES if f.name in args.families], desc="families"):
        rows += check_family(args, fam, args.work)
        (args.work / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    (args.work / "table.md").write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
