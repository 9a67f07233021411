"""What every architecture provides: validation, construction, and its analytic counts."""

from __future__ import annotations

from torch import nn

from tango_lm.models.config import ModelConfig
from tango_lm.models.fixed_geometry import FixedGeometry


def longest_sequence(cfg: ModelConfig, seq_len: int | None) -> str:
    """How a warning names the longest sequence a run computes: the context, or the run's shorter
    `train.seq_len` (a window of 16 over 8-token sequences is full-prefix too)."""
    if seq_len is None or seq_len >= cfg.context_length:
        return f"model.context_length={cfg.context_length}"
    return f"train.seq_len={seq_len}, the length of the run's sequences"


class Architecture:
    """Stateless description of one architecture. Counts exclude the vocabulary tables, which
    belong to the head; they include the final norm (`d`).

    Everything the rest of the toolkit needs to know about an architecture lives here, so a new
    one is this class plus one registry line: the tables of `tango-lm match`, the generated
    presets, the benchmark suite, the reports and the generic tests all read these attributes.
    """

    name: str = ""
    display_name: str = ""  # in reports and tables: "Loop Transformer++"
    description: str = ""  # one line for generated presets: "TANGO (full prefix)"
    family: str = ""  # the paper it comes from: "tango" (arXiv:2608.22117) or "onona" (arXiv:2611.10556)
    # In `tango-lm match` and the generated presets (the TANGO paper's Table 3): after setting it,
    # write its presets with `python tools/make_presets.py` (a test checks they are up to date).
    matched: bool = False
    in_bench_suite: bool = False  # in `tango-lm bench --suite train` (and decode) by default
    uses_heads: bool = True  # False: no multi-head split (GAU, FLASH), so d_model need not divide by heads
    min_depth: int = 1  # fewer applications cannot build it (three sets need three)
    rotating_width: bool = False  # trains with `active_width` (rotating narrow width, docs/design.md §2.6)
    # The Triton ops its mixing runs on CUDA ("tango_mix", "windowed_mix", "relu2_attention"): the
    # kernel tests (interpreted on CPUs, and on a GPU) check each such architecture runs on them.
    triton_ops: tuple[str, ...] = ()
    width_name: str = "gate"  # what `width` is, for generated presets: "gate" (TANGO's F) or "FFN"
    # Geometries of it a paper gives as data (models/fixed_geometry.py), each under its own label:
    # sweeps, `tango-lm match`, the presets and the reports take them from here.
    fixed_geometries: tuple[FixedGeometry, ...] = ()
    decode_state: str = ""  # for readers: what one application's decode state holds (serve/cache.py)
    # A forward may leave a parameter without a gradient (an MoE expert no token chose): DDP has to
    # look for such parameters after every backward, and FSDP cannot train the model.
    skips_parameters: bool = False
    # A token's score depends on the other windows in its forward (MoE: expert capacity is per
    # forward), so runs evaluated in batches of other sizes measure different numbers.
    scores_depend_on_batch: bool = False
    # Under FSDP each layer applied once is a unit of its own, re-gathered for the backward by a
    # hook on its output tensors. A layer that returns none (it writes into a shared structure, as
    # AttnRes's depth sources) stays in the root unit instead.
    layers_return_tensors: bool = True
    # The architecture whose count with the Standard head, at this model's shape, a tokens_per_param
    # budget multiplies (train/config.py tpp_reference_params); empty: its own. The onóna paper
    # budgets every backbone by the Dense model's count (seed 001 Appendix C: "All arms at each size
    # share this budget, including ... MoE models with additional expert parameters").
    budget_reference: str = ""
    # The model fields only some architectures read (window, qk_dim, n_experts, ...) that this one
    # reads: a run that sets another one away from its default is warned that nothing uses it
    # (n_kv_heads=2 on a Transformer++ silently trained full multi-head attention).
    reads: tuple[str, ...] = ()
    # The fields that make a tiny model of it on top of tests/arch_cases.py's base (d = 32, heads
    # of 8): the generic tests build every registered architecture from this.
    tiny: dict = {}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        """Raise UserError for configs this architecture cannot build."""

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        raise NotImplementedError

    @classmethod
    def active_non_embedding_params(cls, cfg: ModelConfig) -> int:
        """The non-embedding parameters one token uses (fewer than all only with experts)."""
        return cls.non_embedding_params(cfg)

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> float:
        """Weights each token multiplies through in one forward (loops counted per application).
        Under rotating narrow-width training only the active columns, averaged over a rotation
        (so possibly fractional)."""
        raise NotImplementedError

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs of token mixing per token, averaged over a causal sequence of seq_len."""
        raise NotImplementedError

    @staticmethod
    def width_multiple(cfg: ModelConfig) -> int:
        """The free width (`width`) is matched in steps of this (docs/design.md §2.8)."""
        return int(cfg.n_heads or 1)

    @staticmethod
    def warnings(cfg: ModelConfig, seq_len: int | None = None) -> list[str]:
        """What a config this architecture builds is likely not meant to be (a windowed model whose
        window covers the whole context, or the run's `seq_len`-token sequences when it trains on
        shorter ones): said when a run starts, one line each."""
        return []

    @staticmethod
    def check_packages(cfg: ModelConfig, on_cuda: bool) -> None:
        """UserError when a package the config's kernels need is missing (a model.*_backend that
        names one), checked before a run writes anything: the ops check only at their first call."""

    @staticmethod
    def decode_state_grows(cfg: ModelConfig) -> bool:
        """Whether the decode state grows with every position (keys, values, gates) rather than
        staying bounded (a window, prefix sums, a recurrent state)."""
        return True

    @classmethod
    def preset_geometry(cls, cfg: ModelConfig) -> list[str]:
        """The shape lines of a generated preset's `model:` section, between `d_model` and
        `vocab_size` (models/preset_catalog.py)."""
        heads = (
            [f"  n_heads: {cfg.n_heads}          # heads of d_h = {cfg.head_dim}"] if cfg.n_heads is not None else []
        )
        return [
            *heads,  # none for an architecture without heads (YAML would read "None" as a string)
            f"  width: {cfg.width}          # F: {cls.width_name} width",
            f"  depth: {cfg.depth}             # block applications",
        ]


def causal_pairs_per_token(seq_len: int) -> float:
    """Average number of visible sources per destination in a causal sequence: (T + 1) / 2."""
    return (seq_len + 1) / 2
