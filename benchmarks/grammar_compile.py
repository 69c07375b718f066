"""What a structured request pays before its first token for its grammar: `GrammarCompiler.constraint` on Gemma-3-270M's
tokenizer (262,144 tokens), for the JSON schemas of benchmarks/grammar_mask.py, a regex and a GBNF grammar.

    python benchmarks/grammar_compile.py                     # this checkout
    PYTHONPATH=OTHER/src python benchmarks/grammar_compile.py  # another checkout, to compare

Per grammar: the median of 200 requests, in us (each compiles the grammar into a matcher of its own). The tokenizer's
table, built once per compiler, is built before anything is timed.
"""

from __future__ import annotations

import json
import statistics
import time

from grammar_mask import ORDER, PERSON

from specdec.config import Grammar
from specdec.grammar import GrammarCompiler
from specdec.models import load_model

GRAMMARS = {
    "json schema (person)": Grammar("json_schema", json.dumps(PERSON)),
    "json schema (order)": Grammar("json_schema", json.dumps(ORDER)),
    "json mode": Grammar("json"),
    "regex (date)": Grammar("regex", r"\d{4}-\d{2}-\d{2}"),
    "gbnf (list)": Grammar("gbnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'),
}
REPEATS = 200


def main() -> None:
    model = load_model("gemma-3-270m")
    compiler = GrammarCompiler(model.tokenizer, frozenset({model.tokenizer.eos_token_id}))
    compiler.constraint(Grammar("regex", "warm"))  # the tokenizer's table
    for name, grammar in GRAMMARS.items():
        compiler.constraint(grammar)
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            compiler.constraint(grammar)
            times.append(time.perf_counter() - start)
        print(f"{name}: {statistics.median(times) * 1e6:.0f} us a request")


if __name__ == "__main__":
    main()
