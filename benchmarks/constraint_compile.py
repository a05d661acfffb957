"""What a costly structured-output constraint does to the others: compile
time against schema size, and how long a small schema waits for its compile
while a large one compiles, on two lanes (large constraints on their own
thread, as served) and on one (every compile behind the other, as before).

    python benchmarks/constraint_compile.py [--patterns 500 1000 2150] [--json PATH]

Schemas: an object of N string properties, each with its own pattern
(llguidance's costliest schema per byte). The real default model's
vocabulary; each figure compiles a schema not compiled before.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import torch
from timing import emit_json

from paged.core.engine.sampling_params import StructuredOutputsParams
from paged.core.engine.structured.compiler import MAX_CONSTRAINT_BYTES, GrammarCompiler, GrammarError
from paged.core.models.files import default_model_path
from paged.core.models.loaders import load_model_files

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"]}


def patterns(n: int) -> StructuredOutputsParams:
    props = {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 9}}}x{i}$"} for i in range(n)}
    return StructuredOutputsParams(json={"type": "object", "properties": props, "title": uuid.uuid4().hex})


def fresh(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={**schema, "title": uuid.uuid4().hex})


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def small_wait(compiler: GrammarCompiler, large_n: int, one_lane: bool) -> float:
    """Seconds a small schema waits for its compile behind a large one."""
    large = patterns(large_n)
    compiler.lane_for(large).submit(compiler.compile, large)
    small = fresh(PERSON)
    start = time.perf_counter()
    (compiler.lane_for(large).submit(compiler.compile, small) if one_lane else compiler.submit(small)).result()
    waited = time.perf_counter() - start
    compiler.lane_for(large).submit(lambda: None).result()  # the large one done before the next figure
    return waited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patterns", type=int, nargs="+", default=[500, 1000, 2150])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = load_model_files(str(default_model_path(quiet=True)), torch.float32, quiet=True)
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, [2])
    compiler.ll_tokenizer()
    rows = []
    for n in args.patterns:
        params = patterns(n)
        size = len(params.key()[1])
        rows.append({"patterns": n, "bytes": size, "compile_s": round(seconds(lambda: compiler.compile(params)), 3)})
        print(f"{n:>6} patterns {size:>8} bytes  compile {rows[-1]['compile_s']:.3f} s")
    largest = max(n for n in args.patterns if len(patterns(n).key()[1]) <= MAX_CONSTRAINT_BYTES)
    two = small_wait(compiler, largest, one_lane=False)
    one = small_wait(compiler, largest, one_lane=True)
    print(f"a small schema's compile behind {largest} patterns: {two * 1e3:.1f} ms on two lanes, "
          f"{one * 1e3:.1f} ms on one")

    huge = patterns(18000)

    def oversized():
        try:
            compiler.compile(huge)
        except GrammarError:
            pass
    refused = seconds(oversized)
    print(f"a {len(huge.key()[1]) / 2**20:.1f} MiB schema refused by its size in {refused * 1e3:.0f} ms")
    emit_json({"benchmark": "constraint_compile", "sizes": rows, "small_wait_two_lanes_s": round(two, 4),
               "small_wait_one_lane_s": round(one, 4), "oversized_refused_s": round(refused, 3),
               "max_constraint_bytes": MAX_CONSTRAINT_BYTES}, args.json)


if __name__ == "__main__":
    main()
