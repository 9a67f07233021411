"""Generate DeepMind Mathematics examples; runs inside the generator's own environment.

This script is started by `tango_lm.data.dmmath` with the Python of a dedicated virtual
environment (numpy, sympy, mathematics-dataset: `dmmath.generator_requirements`). It must
import nothing from tango_lm and only the standard library plus the generator, because tango_lm
is not installed there.

Usage: python dmmath_worker.py CONFIG_JSON

CONFIG_JSON holds {"out_dir", "seed", "counts": {split: examples per module}, "workers"} where
split is one of train-easy, train-medium, train-hard, interpolate, extrapolate. For every
(split, module) it writes `<out_dir>/<split>__<module>.jsonl` with lines
{"split", "module", "question", "answer"}. On stdout it prints `tasks N` first, then one line
`done <split> <module> <examples> <dropped>` per finished module, which the parent turns into a
progress bar.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import multiprocessing
import operator
import os
import random
import re
import sys
import warnings

DIFFICULTY = {"train-easy": 0, "train-medium": 1, "train-hard": 2}

_MODULES: dict[str, dict] = {}
_LIMITS: tuple[int, int] = (0, 0)


def _patch_and_import():
    """Apply the compatibility workarounds and a determinism fix, then import the generator.

    As shipped, mathematics-dataset uses `np.object` (removed in numpy 1.24) and
    `ndarray.itemset` (removed in numpy 2), passes floats to `random.randint` (refused since
    Python 3.12), and imports `base_solution_linear` from `sympy.solvers.diophantine`, which sympy
    moved into the submodule `sympy.solvers.diophantine.diophantine`. `import
    sympy.solvers.diophantine as dio` would bind the *function* `diophantine` (the package
    re-exports it under the same name), so the package is fetched with importlib.
    """
    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.object = object
    random.Random.randrange = _randrange_taking_integral_floats(random.Random.randrange)
    dio = importlib.import_module("sympy.solvers.diophantine")
    inner = importlib.import_module("sympy.solvers.diophantine.diophantine")
    dio.base_solution_linear = inner.base_solution_linear
    if not hasattr(np.ndarray, "itemset"):
        _rewrite_itemset(importlib.import_module("mathematics_dataset.sample.polynomials"))
    composition = importlib.import_module("mathematics_dataset.util.composition")
    composition.expand_entities = _make_expand_entities(composition)
    generate = importlib.import_module("mathematics_dataset.generate")
    settings = importlib.import_module("mathematics_dataset.generate_settings")
    modules = importlib.import_module("mathematics_dataset.modules.modules")
    return np, generate, settings, modules


def _integral(value, position: int) -> int:
    """An argument of randrange as Python 3.11 took it: an integral float is its int (with a
    deprecation warning there), any other float a ValueError."""
    try:
        return operator.index(value)
    except TypeError:
        as_int = int(value)
        if as_int != value:
            raise ValueError(f"non-integer arg {position} for randrange()") from None
        return as_int


def _randrange_taking_integral_floats(randrange):
    """`Random.randrange` that takes integral floats, as Python up to 3.11 did.

    The generator passes floats to `random.randint` (`numbers.round_number`: bounds computed with
    `/` and `10 ** -k`); Python 3.12 made that a TypeError. Taking them as 3.11 did draws the same
    numbers, so Pythons from 3.11 on generate the same questions from one seed.
    """

    def compatible(self, start, stop=None, step=1):
        start = _integral(start, 1)
        stop = None if stop is None else _integral(stop, 2)
        return randrange(self, start, stop, _integral(step, 3))

    return compatible


def _rewrite_itemset(module) -> None:
    """Run `module` again with `a.itemset(i, v)` written `a[i] = v`: numpy 2 removed
    `ndarray.itemset`, which the generator's sample/polynomials.py calls twice, and the
    assignment stores the same values."""
    source = inspect.getsource(module)
    rewritten, count = re.subn(r"(\w+)\.itemset\((\w+), (\w+)\)", r"\1[\2] = \3", source)
    if count != 2:
        raise RuntimeError(f"expected 2 calls of ndarray.itemset in {module.__file__}, found {count}")
    exec(compile(rewritten, module.__file__, "exec"), module.__dict__)


def _make_expand_entities(composition):
    """`composition.expand_entities` with its entities in a reproducible order.

    Upstream collects the entities in a `set` of objects hashed by id(), so the order before its
    shuffle depends on memory addresses and the same seed gives different questions. This keeps
    first-seen order instead; the shuffle that follows makes the distribution the same.
    """

    def expand_entities(context, **kwargs):
        kwargs = kwargs.copy()
        entities = dict.fromkeys(context.child_entities)
        for key, maybe_entity in kwargs.items():
            if isinstance(maybe_entity, composition.Entity):
                entities[maybe_entity] = None
                kwargs[key] = maybe_entity.handle
        entities = list(entities)
        random.shuffle(entities)
        descriptions = []
        for entity in entities:
            descriptions.append(entity.child_description)
            if not entity.expression_used:
                descriptions.append(entity.description)
        return " ".join(s for s in descriptions if s), kwargs

    return expand_entities


def _flatten(tree: dict, prefix: str | None = None, out: dict | None = None) -> dict:
    """{"algebra": {"linear_1d": f}} -> {"algebra__linear_1d": f}, like generate._filter_and_flatten."""
    out = {} if out is None else out
    for key, value in tree.items():
        name = key if prefix is None else f"{prefix}__{key}"
        if isinstance(value, dict):
            _flatten(value, name, out)
        else:
            out[name] = value
    return out


def _load_modules() -> None:
    """Build the module tables once per process (also in pool processes started by spawn)."""
    global _LIMITS
    if _MODULES:
        return
    _, generate, settings, modules = _patch_and_import()
    for split, level in DIFFICULTY.items():
        _MODULES[split] = _flatten(modules.train(generate._make_entropy_fn(level, 3)))
    _MODULES["interpolate"] = _flatten(modules.test())
    _MODULES["extrapolate"] = _flatten(modules.test_extra())
    _LIMITS = (settings.MAX_QUESTION_LENGTH, settings.MAX_ANSWER_LENGTH)


def task_seed(seed: int, split: str, module: str) -> int:
    """Seed for one (split, module); the split name carries the difficulty."""
    digest = hashlib.sha256(f"tango-lm dmmath/{seed}/{split}/{module}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _sample(module_fn) -> tuple[str, str, int]:
    """One problem, redrawing overlong ones as generate.sample_from_module does."""
    max_q, max_a = _LIMITS
    dropped = 0
    while True:
        problem = module_fn()
        question = str(problem.question)
        if len(question) > max_q:
            dropped += 1
            continue
        answer = str(problem.answer)
        if len(answer) > max_a:
            dropped += 1
            continue
        return question, answer, dropped


def _run_task(task: tuple[str, str, int, int, str]) -> tuple[str, str, int, int]:
    split, module, count, seed, out_dir = task
    _load_modules()
    import numpy as np
    import sympy.core.random

    s = task_seed(seed, split, module)
    random.seed(s)
    np.random.seed(s)
    sympy.core.random.seed(s)  # sympy has its own RNGs (randprime, assumptions)
    module_fn = _MODULES[split][module]
    dropped = 0
    path = os.path.join(out_dir, f"{split}__{module}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            question, answer, d = _sample(module_fn)
            dropped += d
            line = {"split": split, "module": module, "question": question, "answer": answer}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return split, module, count, dropped


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        config = json.load(f)
    _load_modules()
    out_dir, seed = config["out_dir"], int(config["seed"])
    tasks = [
        (split, module, int(count), seed, out_dir)
        for split, count in sorted(config["counts"].items())
        for module in sorted(_MODULES[split])
    ]
    print(f"tasks {len(tasks)}", flush=True)
    workers = max(1, min(int(config.get("workers") or os.cpu_count() or 1), len(tasks)))
    if workers == 1:
        results = map(_run_task, tasks)
        for split, module, n, dropped in results:
            print(f"done {split} {module} {n} {dropped}", flush=True)
        return 0
    with multiprocessing.Pool(workers, initializer=_load_modules) as pool:
        for split, module, n, dropped in pool.imap_unordered(_run_task, tasks):
            print(f"done {split} {module} {n} {dropped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
