"""A source's defaults are written on its dataclass and again on its `prepare_*` function and its
command-line options; the three must agree, or Python and `tango-lm data prepare` prepare other data."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import tango_lm.data
from tango_lm.data.sources import SOURCES


def _field_defaults(cls: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _prepare_functions() -> dict[str, object]:
    found = {}
    for info in pkgutil.iter_modules(tango_lm.data.__path__):
        module = importlib.import_module(f"tango_lm.data.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("prepare_") and name != "prepare_source" and fn.__module__ == module.__name__:
                found[name] = fn
    return found


def _same(a: object, b: object) -> bool:
    sequences = (list, tuple)
    return list(a) == list(b) if isinstance(a, sequences) and isinstance(b, sequences) else a == b


# Each prepare_* function and the source class it builds (prepare_files builds the one of its `kind`).
BUILDS = {
    "prepare_code": [SOURCES["code"]],
    "prepare_hf": [SOURCES["hf"]],
    "prepare_lean": [SOURCES["lean"]],
    "prepare_dmmath": [SOURCES["dmmath"]],
    "prepare_files": [SOURCES["text"], SOURCES["jsonl"], SOURCES["parquet"]],
    "prepare_mixture": [SOURCES["mixture"]],
}


def test_every_prepare_function_is_checked():
    assert set(_prepare_functions()) == set(BUILDS)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_prepare_functions_defaults_are_its_sources(name):
    params = inspect.signature(_prepare_functions()[name]).parameters
    for cls in BUILDS[name]:
        fields = _field_defaults(cls)
        for key, param in params.items():
            if key in fields and param.default is not inspect.Parameter.empty:
                assert _same(param.default, fields[key]), f"{name}({key}={param.default!r}) but {cls.__name__}.{key}"


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_sources_command_line_defaults_are_its_fields(name):
    cls = SOURCES[name]
    parser = argparse.ArgumentParser()
    cls.add_arguments(parser)
    fields = _field_defaults(cls)
    for action in parser._actions:
        if action.dest in fields and action.default is not None and action.default is not argparse.SUPPRESS:
            assert _same(action.default, fields[action.dest]), f"--{action.dest} defaults to {action.default!r}"
