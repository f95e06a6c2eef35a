"""Grammar-mask cost per token on CPU, xgrammar against llguidance (issue 32: pick the engine by
measuring). For each engine: compile a JSON schema for the demo tokenizer (no whitespace between
tokens), then walk the tokens of a valid document: per token, compute the allowed-token mask
(a bitmask over the vocabulary) and advance the matcher. Reports compile ms and mask µs per token
(median and p90 over ``--repeats`` walks); also the cost of the tree walk verify does (a copy of
the matcher per node, `target_service.grammar`). ``--acceptance`` instead runs the demo pair
in process (EAGLE-3 5/4/8, fp32) on chat prompts with and without the JSON schema and reports
tokens per round (the draft masks its search by the grammar too, `draft_service.grammar`).

    python -m specmesh.bench.grammar_mask [--tokenizer DIR] [--repeats 20] [--acceptance]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specmesh.defaults import REPO_MODELS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "kind": {"enum": ["function", "class", "module"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
DOCUMENT = '{"name":"fibonacci sequence","age":42,"tags":["math","recursion"],"kind":"function"}'


def _xgrammar(tok_dir: Path, tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    compile_ms = (time.perf_counter() - t0) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, len(hf))
    per_token: list[float] = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            per_token.append(time.perf_counter() - t0)
            assert m.accept_token(t), t
    return {"compile_ms": compile_ms, "mask_us": _stats(per_token)}


def _llguidance(tok_dir: Path, tokens: list[int], repeats: int) -> dict:
    import llguidance

    tok = llguidance.LLTokenizer(str(tok_dir / "tokenizer.json"))
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    m = llguidance.LLMatcher(tok, grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    assert not m.is_error(), m.get_error()
    per_token: list[float] = []
    copy_us: list[float] = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(tok, grammar)
        for t in tokens:
            t0 = time.perf_counter()
            m.compute_bitmask()
            per_token.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m.deep_copy()
            copy_us.append(time.perf_counter() - t0)
            assert m.consume_token(t), t
    return {"compile_ms": compile_ms, "mask_us": _stats(per_token), "copy_us": _stats(copy_us)}


def _stats(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median": round(statistics.median(us), 1), "p90": round(us[int(0.9 * len(us))], 1)}


def acceptance(max_new_tokens: int = 64) -> dict:
    """Tokens per round (bonus included) on the demo pair, with and without the schema."""
    from specmesh.protocol.config import SpecParams
    from specmesh.protocol.constraints import Constraint
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.router.chat import ChatRenderer
    from specmesh.router.engine import Engine
    from specmesh.router.tokenizer import load_tokenizer

    target, draft = REPO_MODELS / "target", REPO_MODELS / "draft"
    fp32 = {"dtype": "float32"}
    engine = Engine(target, draft_model=draft, draft_kind="eagle3", spec=SpecParams(5, 4, 8),
                    target_config=fp32, draft_config=fp32)  # fmt: skip
    chat = ChatRenderer(load_tokenizer(target))
    asks = ["Describe the function fibonacci", "Describe the class Path", "Describe os.walk",
            "Describe the module json", "Describe the function sorted", "Describe dict.get"]  # fmt: skip
    prompts = [chat.render([{"role": "user", "content": a + " as JSON"}]) for a in asks]
    out: dict = {}
    for temperature in (0.0, 0.7):
        for name, constraint in (("none", None), ("json_schema", Constraint.json_schema(SCHEMA))):
            params = [SamplingParams(max_new_tokens, temperature, seed=s, constraint=constraint)
                      for s in range(len(prompts))]  # fmt: skip
            results = engine.generate(prompts, params)
            lens = [n for r in results for n in r.accept_lens]
            out[f"t={temperature} {name}"] = round(sum(lens) / len(lens), 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=REPO_MODELS / "target")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--acceptance", action="store_true")
    args = ap.parse_args(argv)
    if args.acceptance:
        print(json.dumps(acceptance(), indent=1))
        return
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tokens = tokenizer.encode(DOCUMENT, add_special_tokens=False).ids
    out: dict = {"tokens": len(tokens), "vocab": tokenizer.get_vocab_size()}
    for name, fn in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        try:
            out[name] = fn(args.tokenizer, tokens, args.repeats)
        except ImportError as e:
            out[name] = f"not installed: {e}"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
