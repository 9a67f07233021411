"""A new architecture needs no edit to the tests: registering it is enough for the generic checks.

The toy below is a Transformer++ whose feed-forward is a plain squared-ReLU MLP (a `PreNormBlock`
of causal attention and that MLP). It lives only in this file and is registered only while a test runs. Each test calls one of the generic checks the
other test files run over the registry (plain functions, parametrized there by
`arch_cases.names()`): parameter counts against `numel`, FLOPs against FlopCounterMode, causality,
cached decoding against the full forward, activation checkpointing, training through the CLI, and
the Hugging Face export round trip. They build the toy from its class's `tiny` fields, exactly as
they build the shipped architectures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.eval.report import model_name
from tango_lm.layers.prenorm import PreNormBlock
from tango_lm.layers.transformer import CausalSelfAttention
from tango_lm.models.archs.base import Architecture, causal_pairs_per_token
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.serve.cache import LayerState
from tests import arch_cases
from tests.models.test_flops import GENERIC_T, check_reference_count
from tests.models.test_model import check_causal
from tests.models.test_params import check_param_count
from tests.serve.test_generate import check_cached_decoding
from tests.serve.test_hf_export import check_round_trip
from tests.serve.test_static_decode import check_one_graph, check_static_decoding
from tests.train.test_activation_checkpointing import (
    check_fewer_bytes,
    check_same_loss_and_gradients,
    record_checkpoints,
    train_model,
)
from tests.train.test_train_everything import check_trains_through_the_cli, tiny_overrides


class SquaredReluMLP(nn.Module):
    """`down_proj(relu(up_proj h)^2)` with hidden width F."""

    def __init__(self, d_model: int, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, width, bias=False)
        self.down_proj = nn.Linear(width, d_model, bias=False)

    def forward(self, h: torch.Tensor, state: LayerState | None = None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(h)).square())


def toy_block(cfg: ModelConfig) -> PreNormBlock:
    return PreNormBlock(
        cfg.d_model, cfg.norm_eps, CausalSelfAttention(cfg.d_model, cfg.n_heads), SquaredReluMLP(cfg.d_model, cfg.width)
    )


class ToyTransformer(Architecture):
    name = "toy-relu2"
    display_name = "Toy ReLU² Transformer"
    decode_state = "rotated keys and values of every position"
    tiny = {"width": 40}

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        return Backbone(
            [toy_block(cfg) for _ in range(cfg.depth)], list(range(cfg.depth)), cfg.head_dim, cfg.rope_theta
        )

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        d, f = cfg.d_model, cfg.width
        return cfg.depth * (4 * d * d + 2 * d * f + 2 * d) + d

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        d, f = cfg.d_model, cfg.width
        return cfg.depth * (4 * d * d + 2 * d * f)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return int(cfg.depth * 4 * cfg.d_model * causal_pairs_per_token(seq_len))


@pytest.fixture
def toy(monkeypatch) -> str:
    monkeypatch.setitem(ARCHITECTURES, ToyTransformer.name, ToyTransformer)
    return ToyTransformer.name


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_registry_is_all_that_names_it(toy):
    assert toy in arch_cases.names()
    cfg = arch_cases.tiny_config(toy)
    assert (cfg.arch, cfg.width, cfg.n_heads) == (toy, 40, 4)
    assert model_name(toy) == "Toy ReLU² Transformer"


def test_parameter_counts(toy):
    check_param_count(toy)


def test_flops_count(toy, monkeypatch):
    check_reference_count(arch_cases.tiny_config(toy), GENERIC_T, monkeypatch)


def test_causal(toy):
    check_causal(arch_cases.tiny_config(toy))


def test_cached_decoding(toy):
    check_cached_decoding(arch_cases.tiny_config(toy))


def test_static_decoding(toy):
    check_static_decoding(arch_cases.tiny_config(toy))
    check_one_graph(arch_cases.tiny_config(toy, depth=1))


def test_activation_checkpointing_recomputes_the_same(toy, monkeypatch):
    calls = record_checkpoints(monkeypatch)
    model = train_model(arch_cases.tiny_config(toy))
    check_same_loss_and_gradients(model, calls)
    calls.clear()
    check_fewer_bytes(model, calls)


def test_trains_through_the_cli(toy, data_dir, tmp_path, capsys):
    config = tmp_path / "toy.yaml"
    config.write_text(f"model:\n  arch: {toy}\n")
    check_trains_through_the_cli(config, tiny_overrides(toy), data_dir, tmp_path / "run", capsys)


def test_hugging_face_round_trip(toy, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    check_round_trip(transformers, tmp_path, toy)


class ToyWithoutHeads(ToyTransformer):
    name = "toy-relu2-headless"
    uses_heads = False


def test_a_generated_preset_of_an_architecture_without_heads_loads(monkeypatch):
    # The default preset geometry wrote `n_heads: None`, which YAML reads as the string "None":
    # `tango-lm presets` then failed for every preset.
    import yaml

    from tango_lm.models.preset_catalog import _model_yaml

    monkeypatch.setitem(ARCHITECTURES, ToyWithoutHeads.name, ToyWithoutHeads)
    cfg = ModelConfig(arch=ToyWithoutHeads.name, d_model=48, width=40, depth=2, vocab_size=61, context_length=16)
    text = _model_yaml(cfg)
    assert "n_heads" not in text
    assert ModelConfig.from_dict(yaml.safe_load(text)["model"]) == cfg


def test_every_model_field_is_shared_or_read_by_an_architecture():
    # A field only some architectures use must be named in their `reads`, or a run that sets it for
    # another architecture is not warned that nothing reads it (config_checks.unread_model_fields).
    import dataclasses

    from tango_lm.models.config import ModelConfig
    from tango_lm.models.registry import ARCHITECTURES

    shared = {"arch", "head", "d_model", "n_heads", "head_dim", "width", "depth", "vocab_size", "context_length"}
    shared |= {"active_width", "rope_theta", "norm_eps", "init_std", "loss_chunk"}
    read = {f for arch in ARCHITECTURES.values() for f in arch.reads}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields - shared - read == set() and read <= fields and not read & shared
