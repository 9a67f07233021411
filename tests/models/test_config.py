"""Configs (docs/design.md §7): ModelConfig validation, `key=value` overrides, YAML presets and files, and
the training budget."""

from __future__ import annotations

import math

import pytest
import yaml

from tango_lm import ModelConfig, UserError
from tango_lm.train.config import RunConfig, TrainConfig, apply_overrides, load_run_config

SMALL = ["model.d_model=32", "model.head_dim=16", "model.width=48", "model.vocab_size=50", "model.context_length=16"]


# -- ModelConfig validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        (dict(arch="transformer-xl"), ["arch", "transformer-xl"]),
        (dict(head="fancy"), ["head", "fancy"]),
        (dict(d_model="abc"), ["d_model"]),
        (dict(width=1.5), ["width"]),
        (dict(depth=True), ["depth"]),
        (dict(vocab_size=None), ["vocab_size"]),
        (dict(rope_theta="big"), ["rope_theta"]),
        (dict(d_model=64, n_heads=3), ["d_model", "n_heads"]),
        (dict(d_model=50, head_dim=16), ["d_model", "head_dim"]),
        (dict(arch="tango", d_model=64, head_dim=16, width=50), ["width"]),
        (dict(depth=0), ["depth"]),
        (dict(width=0), ["width"]),
        (dict(vocab_size=-3), ["vocab_size"]),
    ],
)
def test_model_config_errors_name_the_field(fields, names):
    with pytest.raises(UserError) as info:
        ModelConfig(**fields)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


def test_model_config_valid_and_derived():
    cfg = ModelConfig(arch="tango", d_model=64, width=64, vocab_size=50)
    assert cfg.n_heads == 2 and cfg.head_dim == 32  # d_h = 32 by default (docs/design.md §1)
    cfg = ModelConfig(arch="untied-transformer", d_model=64, n_heads=8, width=50, vocab_size=50)
    assert cfg.head_dim == 8  # a Transformer++ FFN width need not divide by the heads
    wider = cfg.replace(d_model=128)
    assert (wider.head_dim, wider.n_heads, wider.n_kv_heads) == (8, 16, 16)  # head width kept, heads follow
    with pytest.raises(UserError, match="width"):
        cfg.replace(arch="tango")  # ... but TANGO's gate width must


def test_model_config_from_dict_unknown_field():
    with pytest.raises(UserError, match="colour"):
        ModelConfig.from_dict({"arch": "tango", "colour": "red"})
    cfg = ModelConfig.from_dict(ModelConfig(d_model=64, width=128).to_dict())
    assert cfg == ModelConfig(d_model=64, width=128)


# -- overrides ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("128", 128),
        ("-7", -7),
        ("0.5", 0.5),
        ("1.0e-3", 1e-3),
        ("true", True),
        ("false", False),
        ("null", None),
        ("", None),
        ("wsd", "wsd"),
        ("runs/x y", "runs/x y"),
    ],
)
def test_override_scalars(raw, expected):
    out = apply_overrides({}, [f"train.x={raw}"])
    value = out["train"]["x"]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("raw", "expected"), [("3e-4", 3e-4), ("1e+4", 1e4), ("-2E-3", -2e-3)])
def test_override_exponent_floats(raw, expected):
    assert apply_overrides({}, [f"train.lr={raw}"])["train"]["lr"] == pytest.approx(expected)
    if expected > 0:
        assert load_run_config(None, [f"train.weight_decay={raw}"]).train.weight_decay == pytest.approx(expected)


def test_negative_learning_rate_is_rejected():
    with pytest.raises(UserError, match="train.lr"):
        load_run_config(None, ["train.lr=-2e-3"])


def test_whole_number_float_fills_an_int_field():
    run = load_run_config(None, ["train.tokens=1e6"])
    assert run.train.tokens == 1_000_000 and type(run.train.tokens) is int


def test_numpy_scalars_fill_int_and_float_fields():
    # A sweep script's np.int64 width was refused as "must be int (got 64 of type int64)".
    np = pytest.importorskip("numpy")

    cfg = ModelConfig(d_model=np.int64(64), width=np.uint16(96), rope_theta=np.float32(1e4), depth=np.int32(2))
    assert (cfg.d_model, cfg.depth, cfg.rope_theta) == (64, 2, 1e4)
    assert type(cfg.d_model) is int and type(cfg.depth) is int and type(cfg.rope_theta) is float
    with pytest.raises(UserError, match="model.rope_theta must be a finite number"):
        ModelConfig(rope_theta=np.float64("inf"))


def test_a_non_finite_number_is_answered_with_the_fields_own_default():
    # Every field was offered "a value such as 1e-3": a RoPE base of 1e-3, a grad_clip of 1e-3.
    from tango_lm.train.config import RunConfig

    with pytest.raises(
        UserError,
        match=r"model.rope_theta must be a finite number \(got nan\); give a number such as its default, 10000.0$",
    ):
        ModelConfig(rope_theta=float("nan"))
    with pytest.raises(
        UserError, match=r"train.grad_clip must be a finite number \(got inf\); give a number such as its default, 1.0$"
    ):
        RunConfig.from_dict({"model": {}, "data": {"dir": "d"}, "train": {"grad_clip": float("inf")}})


def test_overrides_dotted_and_bare_keys():
    data = {"model": {"width": 64, "depth": 2}, "train": {"lr": 0.1}}
    out = apply_overrides(data, ["model.width=96", "depth=5", "steps=7", "dir=data/x", "seed=3", "train.lr=0.25"])
    assert out["model"] == {"width": 96, "depth": 5}
    assert out["train"] == {"lr": 0.25, "steps": 7, "seed": 3}  # bare keys go to the section owning them
    assert out["data"] == {"dir": "data/x"}
    assert data == {"model": {"width": 64, "depth": 2}, "train": {"lr": 0.1}}  # input left alone
    assert apply_overrides({}, ["model.a=b=c"])["model"]["a"] == "b=c"  # split at the first '='
    # a bare key no section has is an error that names the field meant, not an unknown model field
    with pytest.raises(
        UserError,
        match=r"override 'warmup_step=3': no section has a field 'warmup_step' \(did you "
        r"mean train.warmup_steps\?\); write section.field=value",
    ):
        apply_overrides({}, ["warmup_step=3"])


def test_a_budget_override_replaces_the_configs_budget_of_any_kind():
    # `train.tokens=1e9` on a preset that writes steps trained the preset's steps (steps win in
    # total_steps), and config.json recorded both.
    base = {"train": {"steps": 6, "lr": 0.1}}
    assert apply_overrides(base, ["train.tokens=128"])["train"] == {"tokens": 128, "lr": 0.1}
    assert apply_overrides(base, ["tokens_per_param=2"])["train"] == {"tokens_per_param": 2, "lr": 0.1}
    assert apply_overrides({"train": {"tokens": 9}}, ["train.steps=3"])["train"] == {"steps": 3}
    assert apply_overrides(base, ["train.tokens="])["train"] == {"steps": 6, "lr": 0.1, "tokens": None}
    assert (
        load_run_config("tango-70m-d4", ["train.tokens_per_param=1"]).total_steps() == 1069
    )  # 70,002,176 parameters / 65,536 tokens a step
    with pytest.raises(UserError, match="train.steps=3 and tokens=5 both set the training budget"):
        apply_overrides(base, ["train.steps=3", "tokens=5"])


@pytest.mark.parametrize(
    ("override", "word"),
    [("model.width", "key=value"), ("optim.lr=1", "optim")],
)
def test_bad_overrides(override, word):
    with pytest.raises(UserError, match=word):
        apply_overrides({}, [override])


# -- load_run_config -----------------------------------------------------------------------------


def test_preset_with_overrides():
    base = load_run_config("tango-70m-d4", [])
    assert (base.model.arch, base.model.d_model, base.model.width, base.model.depth) == ("tango", 512, 28480, 4)
    cfg = load_run_config(
        "tango-70m-d4", ["model.depth=8", "width=28448", "train.steps=10", "lr=0.002", "compile=true"]
    )
    assert (cfg.model.depth, cfg.model.width) == (8, 28448)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.compile) == (10, 0.002, True)
    assert cfg.train.batch_size == base.train.batch_size and cfg.data == base.data  # untouched fields kept
    with pytest.raises(UserError, match="width"):
        load_run_config("tango-70m-d4", ["model.width=28481"])  # not a multiple of 16 heads


def test_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  arch: loop-transformer\n  d_model: 64\n  head_dim: 16\n  width: 40\n"
        "train:\n  lr: 0.01\n  schedule: cosine\ndata:\n  dir: somewhere\n"
    )
    cfg = load_run_config(str(path), ["model.width=44", "train.seq_len=null"])
    assert (cfg.model.arch, cfg.model.n_heads, cfg.model.width) == ("loop-transformer", 4, 44)
    assert (cfg.train.lr, cfg.train.schedule, cfg.data.dir) == (0.01, "cosine", "somewhere")
    assert cfg.train.seq_len is None and cfg.seq_len() == cfg.model.context_length


def test_yaml_file_exponent_float(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 3e-4\n")
    assert load_run_config(str(path), []).train.lr == pytest.approx(3e-4)


def test_leading_zeros_are_decimal_not_yaml_1_1_octal(tmp_path):
    # YAML 1.1 read `seed: 017` as 15 and `steps: 010` as 8, in files and overrides, unsaid.
    from tango_lm.train.config import dump_yaml, parse_yaml

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 010\n  seed: 017\n")
    cfg = load_run_config(str(path), ["train.data_seed=010", "model.depth=+02"])
    assert (cfg.train.steps, cfg.train.seed, cfg.train.data_seed, cfg.model.depth) == (10, 17, 10, 2)
    # no octal to YAML 1.1 either: strings as before (a SLURM account 0815, a config.yaml written so)
    assert [parse_yaml(t) for t in ("09", "0815", "0_9")] == ["09", "0815", "0_9"]
    assert [parse_yaml(t) for t in ("0", "00", "-017", "1_000", "0x10", "0b11", "017.5")] == [
        0,
        0,
        -17,
        1000,
        16,
        3,
        17.5,
    ]
    assert parse_yaml(dump_yaml({"name": "017", "other": "09"})) == {"name": "017", "other": "09"}  # strings stay


@pytest.mark.parametrize(
    "text",
    ["model: [unclosed\n", "model:\n  width: 3\n bad-indent: 4\n", "model: {a: 1\n"],
)
def test_malformed_yaml_is_user_error(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match="YAML"):
        load_run_config(str(path), [])


def test_a_key_written_twice_is_refused_and_a_merge_key_may_be_overridden(tmp_path, capsys):
    # YAML keeps a repeated key's last value: a second model: section trained a default-sized model.
    path = tmp_path / "twice.yaml"
    for text in ("model: {depth: 1}\nmodel: {depth: 2}\n", "train:\n  lr: 0.1\n  lr: 0.002\n"):
        path.write_text(text)
        with pytest.raises(UserError, match=r"repeats the key '(model|lr)' at line (2|3) \(YAML would keep"):
            load_run_config(str(path), [])
    path.write_text("model: {depth: 2}\ntrain:\n  <<: &b {lr: 0.1, steps: 3}\n  lr: 0.002\n")  # not a repeat
    assert (load_run_config(str(path), []).train.lr, load_run_config(str(path), []).train.steps) == (0.002, 3)


def test_a_run_configs_yaml_reads_back_as_the_config_it_records(tmp_path):
    # config.yaml was written by YAML 1.1's writer, which leaves 1e3 plain; tango-lm reads 1e3 as
    # a number: a run in data.dir '1e3' could not be run again from its own config.yaml.
    from tango_lm.train.config import dump_yaml

    run = load_run_config("tango-70m-d4", ["data.dir='1e3'", "train.out_dir='2e-2'", "train.wandb_project='on'"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(run.to_dict()))
    assert load_run_config(str(path), []).to_dict() == run.to_dict()


def test_n_heads_and_head_dim_that_disagree_with_d_model_are_refused():
    # head_dim silently followed n_heads: model.n_heads=2 model.head_dim=8 at d_model 32 gave 16.
    with pytest.raises(UserError, match=r"n_heads=12 heads of head_dim=32 are 384 channels, not d_model=768"):
        load_run_config("dense-142m", ["model.n_heads=12", "model.head_dim=32"])
    assert load_run_config("dense-142m", ["model.n_heads=12", "model.head_dim=64"]).model.n_heads == 12


def test_non_mapping_yaml_and_missing_sources(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="mapping"):
        load_run_config(str(path), [])
    with pytest.raises(UserError, match="no-such-preset"):
        load_run_config("no-such-preset", [])
    with pytest.raises(UserError):
        load_run_config(str(tmp_path / "missing.yaml"), [])


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["optimizer_steps=3", "model.arch=tango"], ["optimizer_steps"]),  # bare unknown key -> model field
        (["model.colour=red"], ["colour"]),
        (["train.colour=red"], ["train.colour"]),
        (["data.colour=red"], ["data.colour"]),
        (["train.batch_size=abc"], ["train.batch_size"]),
        (["train.lr=fast"], ["train.lr"]),
        (["train.schedule=linear"], ["train.schedule"]),
        (["train.batch_size=0"], ["train.batch_size"]),
        (["model.d_model=abc"], ["d_model"]),
        (["model.width=1.5"], ["width"]),
        (["model.depth=0"], ["depth"]),
        (["model.arch=nope"], ["arch"]),
    ],
)
def test_bad_fields_are_user_errors(overrides, words):
    with pytest.raises(UserError) as info:
        load_run_config(None, overrides)
    for word in words:
        assert word in str(info.value)


def test_unknown_section_in_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  d_model: 64\noptim:\n  lr: 1\n")
    with pytest.raises(UserError, match="optim"):
        load_run_config(str(path), [])
    with pytest.raises(UserError, match="optim"):
        RunConfig.from_dict({"optim": {}})


# -- budget ------------------------------------------------------------------------------------


def budget_config(*overrides: str) -> RunConfig:
    return load_run_config(None, [*SMALL, "train.batch_size=2", "train.grad_accum=3", *overrides])


def test_total_steps_from_steps_and_priority():
    assert budget_config("train.steps=17").total_steps() == 17
    # steps wins when a config file sets several budgets (overrides replace the file's: one at a time).
    run = budget_config("train.steps=17")
    run.train.tokens, run.train.tokens_per_param = 100000, 5
    assert run.total_steps() == 17


def test_total_steps_from_tokens():
    per_step = 2 * 3 * 16  # batch x accumulation x context_length
    assert budget_config(f"train.tokens={per_step * 10}").total_steps() == 10
    for tokens in (per_step * 10 + 1, per_step * 10 - 1, 5):
        steps = budget_config(f"train.tokens={tokens}").total_steps()
        assert steps >= 1 and abs(steps * per_step - tokens) < per_step
    # seq_len, when given, sets the tokens per step instead of context_length.
    assert budget_config("train.seq_len=8", f"train.tokens={2 * 3 * 8 * 10}").total_steps() == 10


def test_total_steps_from_tokens_per_param():
    cfg = budget_config("train.tokens_per_param=2.5")
    d, f, v = 32, 48, 50
    total = 2 * d * d + 3 * d * f + 2 * d + v * d  # TANGO, docs/design.md §2.2
    budget = 2.5 * total
    per_step = 2 * 3 * 16
    steps = cfg.total_steps()
    assert abs(steps * per_step - budget) < per_step
    assert steps == pytest.approx(math.floor(budget / per_step), abs=1)


def test_no_budget_is_user_error():
    assert TrainConfig().steps is None
    with pytest.raises(UserError, match="steps"):
        budget_config().total_steps()


@pytest.mark.parametrize("text", ["model: 5\n", "train: abc\n", "data:\n  - a\n"])
def test_section_that_is_not_a_mapping_is_user_error(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=text.split(":")[0]):
        load_run_config(str(path), [])


@pytest.mark.parametrize(
    "override", ["train.steps=-1", "train.tokens=-5", "train.tokens_per_param=-2.0", "train.seq_len=0"]
)
def test_non_positive_budget_is_user_error(override):
    with pytest.raises(UserError, match=override.split("=")[0]):
        load_run_config(None, [*SMALL, override])


@pytest.mark.parametrize(
    ("preset", "overrides", "heads", "head_dim"),
    [
        ("tango-70m-d4", ["model.head_dim=64"], 8, 64),  # the preset writes n_heads=16: head_dim was ignored
        ("tango-70m-d4", ["model.d_model=256"], 8, 32),  # heads keep d_h = 32 (were 16 heads of 16)
        ("tango-70m-d4", ["model.n_heads=8"], 8, 64),
        ("tango-70m-d4", ["model.n_heads=32", "model.d_model=1024"], 32, 32),
        ("tango-70m-d4", ["model.width=1024"], 16, 32),  # head shape untouched by other fields
        ("dense-142m", ["model.head_dim=32"], 24, 32),  # the preset writes both n_heads and head_dim
        ("dense-142m", ["model.n_heads=24", "model.n_kv_heads=12"], 24, 32),
        ("dense-142m", ["model.d_model=384", "model.n_kv_heads=3"], 6, 64),
        ("dense-1b", ["model.n_heads=null"], 32, 64),  # unpinning the head count keeps the head width
    ],
)
def test_overrides_change_the_head_shape_they_name(preset, overrides, heads, head_dim):
    model = load_run_config(preset, overrides).model
    assert (model.n_heads, model.head_dim) == (heads, head_dim)
    assert model.n_heads * model.head_dim == model.d_model


def test_a_run_configs_head_shape_follows_an_override(tmp_path):
    # A run's config.yaml writes every derived field: n_kv_heads = n_heads (no GQA) and head_dim.
    saved = load_run_config("dense-142m", ["model.n_kv_heads=12"]).to_dict()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    model = load_run_config(str(path), ["model.d_model=384"]).model
    assert (model.n_heads, model.n_kv_heads, model.head_dim) == (6, 6, 64)  # n_kv_heads 12 stayed: an error
    model = load_run_config(str(path), ["model.n_heads=24"]).model
    assert (model.n_heads, model.n_kv_heads, model.head_dim) == (24, 24, 32)
    gqa = load_run_config("dense-142m", []).to_dict()  # 12 heads share 6 key/value heads: groups of 2 kept
    path.write_text(yaml.safe_dump(gqa))
    for overrides, shape in [
        (["model.d_model=1536"], (24, 12, 64)),
        (["model.n_heads=24"], (24, 12, 32)),
        (["model.head_dim=32"], (24, 12, 32)),
        (["model.n_heads=24", "model.n_kv_heads=3"], (24, 3, 32)),
    ]:
        model = load_run_config(str(path), overrides).model
        assert (model.n_heads, model.n_kv_heads, model.head_dim) == shape, overrides
        assert load_run_config("dense-142m", overrides).model.n_kv_heads == shape[1]  # the preset alike
    with pytest.raises(UserError, match="n_kv_heads=6"):
        load_run_config(str(path), ["model.n_heads=3"])  # no group of 2 in 3 heads: the error says so
    # d_model=64 keeps the 64-wide heads: one head, no group of 2; the error says why and what to set
    message = r"n_heads=1 \(d_model=64 / head_dim=64\) is not a multiple of n_kv_heads=6; set model.n_kv_heads to one of \[1\]"
    with pytest.raises(UserError, match=message):
        load_run_config("dense-142m", ["model.d_model=64"])
    assert load_run_config("dense-142m", ["model.d_model=64", "model.n_kv_heads=1"]).model.n_heads == 1


def test_a_default_eval_capacity_follows_new_experts_and_a_chosen_one_stays(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(load_run_config("moe-142m", []).to_dict()))  # writes 4.0 = E/k
    assert load_run_config(str(path), ["model.n_experts=16"]).model.capacity_factor_eval == 8.0
    assert load_run_config(str(path), ["model.moe_top_k=1"]).model.capacity_factor_eval == 8.0
    chosen = load_run_config("moe-142m", ["model.capacity_factor_eval=2.0"]).to_dict()
    path.write_text(yaml.safe_dump(chosen))
    assert load_run_config(str(path), ["model.n_experts=16"]).model.capacity_factor_eval == 2.0


def test_head_overrides_read_the_width_in_use_and_a_group_without_n_heads(tmp_path):
    path = tmp_path / "config.yaml"
    # a copied preset whose head_dim was left stale: n_heads decides the width in use (64)
    path.write_text(yaml.safe_dump({"model": {"arch": "dense", "d_model": 512, "n_heads": 8, "head_dim": 32}}))
    model = load_run_config(str(path), ["model.d_model=1024"]).model
    assert (model.n_heads, model.head_dim) == (16, 64)
    # n_kv_heads written without n_heads: 8 heads of 32 in groups of 4 stay groups of 4
    path.write_text(yaml.safe_dump({"model": {"arch": "dense", "d_model": 256, "n_kv_heads": 2}}))
    model = load_run_config(str(path), ["model.d_model=512"]).model
    assert (model.n_heads, model.n_kv_heads) == (16, 4)


def test_a_directory_named_like_a_preset_does_not_hide_the_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tango-70m-d4").mkdir()  # a run or data directory of that name, say
    assert load_run_config("tango-70m-d4", []).model.width == 28480
    with pytest.raises(UserError, match="is a directory"):
        load_run_config(str(tmp_path), [])


def test_a_head_dim_that_disagrees_with_n_heads_is_refused_in_python_too():
    # ModelConfig(d_model=1024, n_heads=16, head_dim=128) built heads of 64, unsaid (from_dict and
    # the command line refused it); the default 32 cannot be told from a given one, so it follows.
    with pytest.raises(UserError, match=r"model.n_heads=16 heads of head_dim=128 are 2048 channels, not d_model=1024"):
        ModelConfig(arch="dense", d_model=1024, n_heads=16, head_dim=128, width=64, depth=1, vocab_size=50)
    agreed = ModelConfig(arch="dense", d_model=1024, n_heads=8, head_dim=128, width=64, depth=1, vocab_size=50)
    assert agreed.head_dim == 128 and agreed.replace(n_heads=16).head_dim == 64  # a new n_heads: head_dim follows
    assert ModelConfig(arch="dense", d_model=256, n_heads=4, width=64, depth=1, vocab_size=50).head_dim == 64
