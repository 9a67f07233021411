"""Run configuration: the model, the data and the training protocol (docs/design.md §6), and the loader for
YAML presets/files with `key=value` overrides (docs/design.md §7)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tango_lm.errors import UserError, closest, did_you_mean
from tango_lm.models.config import ModelConfig, check_type

PRESET_DIR = Path(__file__).resolve().parent.parent / "models" / "presets"


class RepeatedKey(yaml.constructor.ConstructorError):
    """A key written twice in one mapping: YAML keeps the last value and loses the first unsaid
    (a second `model:` section replaced the first whole)."""

    def __init__(self, key: str, mark: Any) -> None:
        super().__init__(None, None, f"repeats the key {key!r}", mark)
        self.key = key


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-4` (no dot) as a string; researchers write learning rates that way.
    It reads `017` as the octal 15 (`seed: 017` trained seed 15, `steps: 010` 8 steps, unsaid):
    a number it would read as octal is decimal here, as YAML 1.2 and a reader take it (`0x`, `0b`
    keep their bases; `09`, `0815`, no octal, stay the strings YAML 1.1 reads, a SLURM account say). A key repeated in one mapping is an error (merge keys `<<` may still be overridden)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        digits = text.lstrip("+-")
        if len(digits) > 1 and digits.startswith("0") and digits.isdigit():
            return int(text, 10)
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise RepeatedKey(key_node.value, key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


class _NotBase60:
    """YAML 1.1 reads `12:00:00` as the base-60 integer 43200 (and a sweep's SLURM time of 12 hours
    as 30 days): a number resolver that leaves anything with a colon a string."""

    def __init__(self, regexp: re.Pattern) -> None:
        self.regexp = regexp

    def match(self, value: str) -> re.Match | None:
        return None if ":" in value else self.regexp.match(value)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, _NotBase60(rx) if tag.endswith((":int", ":float")) else rx) for tag, rx in resolvers]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


class _Dumper(yaml.SafeDumper):
    """Quotes every string `parse_yaml` would not read back as that string (`1e3` is a number to
    it, not to YAML 1.1's writer), so a run's config.yaml loads as the config it records."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    try:
        same = parse_yaml(value) == value
    except yaml.YAMLError:
        same = False
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=None if same else "'")


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Any) -> str:
    """YAML text that `parse_yaml` reads back as `data` (keys in their order)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def check_key_names(data: dict[Any, Any], where: str) -> None:
    """UserError for a section or field key that YAML read as something other than a name (a bare
    `1:`, `null:`, or `on:`, which YAML 1.1 reads as true), before anything looks it up."""
    for section, fields in [(None, data), *((k, v) for k, v in data.items() if isinstance(v, dict))]:
        for key in fields:
            if not isinstance(key, str):
                inside = f" in section {section!r}" if section is not None else ""
                kinds = ((bool, "a boolean"), (type(None), "null"), ((int, float), "a number"))
                kind = next((name for types, name in kinds if isinstance(key, types)), f"a {type(key).__name__}")
                raise UserError(
                    f"{where} has the key {key!r}{inside}, which YAML read as {kind}, not a name; "
                    "write the field's name (quoted if it is on/off/yes/no/null or a number) or remove it"
                )


def yaml_error_text(exc: Exception) -> str:
    """What is wrong with a YAML text, for a one-line error that follows its file's name."""
    line = getattr(getattr(exc, "problem_mark", None), "line", None)
    where = f" at line {line + 1}" if line is not None else ""
    if isinstance(exc, RepeatedKey):
        return f"repeats the key {exc.key!r}{where} (YAML would keep only its last value); keep one"
    return f"is not valid YAML{where}; fix its syntax"


@dataclass(kw_only=True)
class DataConfig:
    """A prepared dataset directory (`tango-lm data prepare ...`) and the split names to use."""

    dir: str = "data/dmmath-byte"
    train_split: str = "train"
    dev_split: str = "dev"
    test_split: str = "test"


@dataclass(kw_only=True)
class TrainConfig:
    """Training protocol. The budget is `steps`, or `tokens`, or `tokens_per_param` (TPP, counted
    against the model's total with the Standard head: `tpp_reference_params`), whichever is set;
    `steps` wins when several are."""

    out_dir: str = "runs/default"
    seed: int = 17  # model seed: initialization
    data_seed: int = 101  # data-order seed, separate from the model seed (seed pairs 17/101)
    # A new window permutation each pass over the data (true), or the first one again on every
    # pass (false: the onóna paper's Appendix C, "the same permutation repeats").
    reshuffle_each_epoch: bool = True
    seq_len: int | None = None  # default: model.context_length
    batch_size: int = 8  # windows per micro-batch over all processes; each of N takes batch_size / N
    grad_accum: int = 1
    steps: int | None = None
    tokens: int | None = None
    tokens_per_param: float | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: str = "wsd"  # wsd | cosine | constant
    decay_fraction: float = 0.2  # wsd: share of steps in the final linear decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_windows: int = 64  # fixed dev windows evaluated on the schedule
    eval_sample_seed: int | None = None  # None: the first eval_windows dev windows; else sampled with this seed
    test_windows: int | None = None  # None: the whole test split
    eval_batch_size: int | None = None  # windows per eval forward (default: batch_size / processes)
    select: str = "best"  # test the best-dev checkpoint (TANGO protocol) or the final one (onóna)
    save_every: int = 200
    keep_last: int = 2  # newest step directories kept, besides the best-dev ones they name (prune_checkpoints)
    log_every: int = 10
    precision: str = "auto"  # auto (bf16 autocast on GPUs that support it) | fp32 | bf16
    compile: bool = False
    # Recompute each block application in the backward (torch.utils.checkpoint, non-reentrant): autograd
    # keeps each application's input instead of its activations, for one more forward of the body.
    activation_checkpointing: bool = False
    device: str = "auto"
    progress: bool = True  # a bar on a terminal, lines in a log file (train/progress_display.py)
    # Under torchrun (docs/distributed.md): ddp replicates the model, fsdp shards it (FSDP2).
    # The global batch per optimizer step is batch_size * grad_accum windows on any process count.
    parallel: str = "none"  # none | ddp | fsdp
    checkpoint_format: str = "full"  # full: one safetensors file (any process count) | sharded: DCP shards
    # Where the log goes (train/loggers/): jsonl (metrics.jsonl, always listed), tensorboard, wandb.
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "tango-lm"
    # Updates with a non-finite loss or gradient norm are skipped (train/nonfinite.py); more than
    # this many in a row stop the run, keeping the last checkpoint.
    max_nonfinite_steps: int = 5


_CHOICES = {
    "train.schedule": ("wsd", "cosine", "constant"),
    "train.select": ("best", "final"),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.parallel": ("none", "ddp", "fsdp"),
    "train.checkpoint_format": ("full", "sharded"),
}


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        check_key_names(data, "the config")
        check_sections(data)
        model = ModelConfig.from_dict(dict(data.get("model") or {}))
        run = cls(
            model=model,
            data=_section(DataConfig, "data", data.get("data") or {}),
            train=_section(TrainConfig, "train", data.get("train") or {}),
        )
        if run.seq_len() > model.context_length:  # here, not at training: a sweep's dry run lists it
            raise UserError(
                f"train.seq_len={run.seq_len()} is longer than model.context_length={model.context_length}; lower seq_len"
            )
        return run

    def total_steps(self) -> int:
        """Optimizer steps implied by the budget."""
        t = self.train
        per_step = t.batch_size * t.grad_accum * self.seq_len()
        steps = budget_steps(t.steps, t.tokens, t.tokens_per_param, per_step, lambda: tpp_reference_params(self.model))
        if steps is None:
            raise UserError("no training budget: set train.steps, train.tokens or train.tokens_per_param")
        return steps

    def seq_len(self) -> int:
        return self.train.seq_len or self.model.context_length


MAX_SEED = 2**40


def _section(cls: type, name: str, values: dict[str, Any]) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    for key, value in values.items():
        if key not in known:
            raise UserError(
                f"unknown field {name}.{key}{did_you_mean(key, known)}; known fields are: {', '.join(sorted(known))}"
            )
        if name == "train" and key == "loggers":
            from tango_lm.train.loggers import logger_names

            values[key] = logger_names(f"{name}.{key}", value)
            continue
        values[key] = value = check_type(f"{name}.{key}", value, known[key].type, known[key].default)
        choices = _CHOICES.get(f"{name}.{key}")
        if choices and value not in choices:
            raise UserError(f"{name}.{key} must be one of {', '.join(choices)} (got {value!r})")
    obj = cls(**values)
    positive = (
        "batch_size",
        "grad_accum",
        "eval_every",
        "save_every",
        "log_every",
        "eval_windows",
        "keep_last",
        "steps",
        "tokens",
        "seq_len",
        "test_windows",
        "eval_batch_size",
        "warmup_steps",
        "max_nonfinite_steps",
    )
    for key in positive:
        value = getattr(obj, key, None)
        low = 0 if key in ("warmup_steps", "max_nonfinite_steps") else 1
        if value is not None and value < low:
            raise UserError(f"{name}.{key} must be at least {low} (got {value})")
    for key in ("tokens_per_param", "lr", "grad_clip"):
        value = getattr(obj, key, None)
        if value is not None and value <= 0:
            raise UserError(f"{name}.{key} must be positive (got {value})")
    ranges = {
        "beta1": (0, 1, False),
        "beta2": (0, 1, False),
        "min_lr_ratio": (0, 1, True),
        "decay_fraction": (0, 1, True),
    }
    for key, (lo, hi, hi_ok) in ranges.items():
        value = getattr(obj, key, None)
        if value is not None and not (lo <= value < hi or (hi_ok and value == hi)):
            raise UserError(f"{name}.{key} must be in [{lo}, {hi}{']' if hi_ok else ')'} (got {value})")
    for key in ("seed", "data_seed", "eval_sample_seed"):
        # torch's generators take 64 bits; the loader's epoch seeds are data_seed * 1,000,003 + epoch
        value = getattr(obj, key, None)
        if value is not None and not 0 <= value < MAX_SEED:
            raise UserError(f"{name}.{key} must be between 0 and 2**40 - 1 (got {value})")
    if getattr(obj, "weight_decay", 0) < 0:
        raise UserError(f"{name}.weight_decay must be >= 0 (got {obj.weight_decay})")
    for key in ("dev_split", "test_split") if isinstance(obj, DataConfig) else ():
        # dev selects the checkpoint and test is the reported number: neither may be training text
        if getattr(obj, key) == obj.train_split:
            raise UserError(
                f"{name}.{key} is {obj.train_split!r}, the training split: its NLL would be of training text; "
                f"name a held-out split (the dataset's dev or test), or set {name}.train_split to another"
            )
    return obj


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def read_yaml(source: str) -> dict[str, Any]:
    """A preset name, a YAML file path or a run directory -> its mapping. A run directory gives its
    resolved `config.yaml` with `train.out_dir` the directory named, wherever the run was moved:
    `tango-lm train runs/x --resume` continues that run, `... train.out_dir=runs/y` starts its twin."""
    from tango_lm.train.run_dir import is_run_dir

    path, run_dir = Path(source), None
    if not path.is_file():
        preset = PRESET_DIR / f"{source}.yaml"
        if preset.is_file():
            path = preset
        elif path.is_dir() and is_run_dir(path) and (path / "config.yaml").is_file():
            path, run_dir = path / "config.yaml", source
        elif path.is_dir():
            raise UserError(
                f"config {source} is a directory but not a run directory; give a YAML file, a preset name or a run"
            )
        elif path.suffix in (".yaml", ".yml") or "/" in source:
            raise UserError(f"config file {source} does not exist; give a YAML file or a preset name")
        else:
            from tango_lm.models.registry import ARCHITECTURES

            if source in ARCHITECTURES:  # an architecture's name where a config goes
                hint = f"; model.arch={source} names the architecture, `tango-lm presets {source}` lists its presets"
            else:
                hint = f"{did_you_mean(source, list_presets())}; `tango-lm presets` lists them"
            raise UserError(f"no preset or file named {source!r}{hint}")
    # A run's config.yaml that is damaged has a copy: the config.json the trainer writes beside it.
    restore = f"; the config.json beside it holds the same config, and JSON is YAML: cp {run_dir}/config.json {path}"
    try:
        data = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        if run_dir is not None:
            raise UserError(f"the run's config {path} is not text (damaged){restore}") from None
        raise UserError(f"config file {path} is not text (not UTF-8); give a YAML file") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {path} ({exc.strerror or exc}); check its permissions") from None
    except yaml.YAMLError as exc:
        if run_dir is not None:
            raise UserError(f"the run's config {path} {yaml_error_text(exc)} (damaged?){restore}") from None
        raise UserError(f"config file {path} {yaml_error_text(exc)}") from None
    if run_dir is not None and not data:  # never the defaults in place of the run's config
        raise UserError(f"the run's config {path} is empty (cut short, say by a full disk){restore}")
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must be a mapping with model/data/train sections")
    check_key_names(data, f"config file {path}")
    if run_dir is not None and isinstance(data.get("train"), dict):
        data["train"]["out_dir"] = str(run_dir)
    return data


BUDGET_FIELDS = ("steps", "tokens", "tokens_per_param")  # train fields of which one sets the budget


def tpp_reference_params(model: Any) -> int:
    """The count a tokens-per-parameter budget multiplies: the model's total parameters with the
    Standard head, of its architecture's `budget_reference` at its shape (the onóna backbones: the
    Dense model), so every head and backbone of a comparison trains on the same tokens (seed 001
    §3.1: "40 tokens per parameter based on the Dense Standard parameter count"; a sweep counts so
    too). A twin-table head's own count gave onóna 27% more steps than Standard at dense-142m, and
    MoE's own count (all experts) 2.6 times the paper's tokens at moe-142m."""
    from tango_lm.models.registry import ARCHITECTURES

    reference = ARCHITECTURES[model.arch].budget_reference or model.arch
    return model.replace(arch=reference, head="standard").num_params()["total"]


def budget_steps(
    steps: int | None,
    tokens: int | None,
    tokens_per_param: float | None,
    tokens_per_step: int,
    total_params: Callable[[], int],
) -> int | None:
    """Optimizer steps a budget gives (`steps` wins, then `tokens`, then `tokens_per_param` of
    `total_params()`, each rounded up to whole steps); None when no budget is set."""
    if steps is not None:
        return steps
    if tokens is not None:
        return max(1, -(-tokens // tokens_per_step))
    if tokens_per_param is not None:
        tokens = tokens_per_param * total_params()
        if not tokens < 2**63 * tokens_per_step:  # as train.steps and train.tokens past 64 bits: a typo, not a run
            raise UserError(
                f"train.tokens_per_param={tokens_per_param:g} gives {tokens / tokens_per_step:.3g} steps, which "
                "does not fit in 64 bits; a typo? give a smaller value"
            )
        return max(1, -(-int(tokens) // tokens_per_step))
    return None


# Train fields that say where and how a run logs, checkpoints, compiles or spreads over processes,
# not what it computes: a sweep's finished run stays done, and a report compares runs, across them.
LOGISTICS_FIELDS = frozenset(
    {
        "out_dir", "device", "progress", "loggers", "wandb_project", "save_every", "keep_last", "log_every",
        "compile", "activation_checkpointing", "parallel", "checkpoint_format", "max_nonfinite_steps",
    }
)  # fmt: skip


SECTIONS_OF_A_RUN = ("model", "data", "train")


def check_sections(data: dict[str, Any]) -> None:
    """UserError for a config section that is not one of `SECTIONS_OF_A_RUN` (with the closest name:
    `modle: 1` was said to be "no mapping") or whose value is no mapping."""
    for name, value in data.items():
        if name not in SECTIONS_OF_A_RUN:
            raise UserError(
                f"unknown config section {name!r}{did_you_mean(str(name), SECTIONS_OF_A_RUN)}; "
                "sections are model, data and train"
            )
        if not isinstance(value or {}, dict):
            raise UserError(f"config section {name!r} must be a mapping of field: value (got {value!r})")


def apply_overrides(data: dict[str, Any], overrides: list[str], bare_section: str | None = None) -> dict[str, Any]:
    """Apply `section.key=value` overrides (values parsed as YAML scalars). A key without a section
    goes to the section that has a field of that name (model first). An override of the budget
    (`train.steps`, `tokens` or `tokens_per_param`) replaces the config's, whichever kind it is."""
    check_sections(data)
    out = {k: dict(v or {}) for k, v in data.items()}
    model_changes: dict[str, Any] = {}
    budgets: dict[str, str] = {}  # budget field -> the override that sets it
    fields = {
        "model": {f.name for f in dataclasses.fields(ModelConfig)},
        "train": {f.name for f in dataclasses.fields(TrainConfig)},
        "data": {f.name for f in dataclasses.fields(DataConfig)},
    }
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not key=value; write e.g. model.width=1024")
        key, raw = item.split("=", 1)
        try:
            value = parse_yaml(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        if "." in key:
            section, name = key.split(".", 1)
        else:
            owners = [s for s in ("model", "train", "data") if key in fields[s]]
            if not owners and bare_section is None:  # no section has it: say which field was meant
                owner = {f: s for s in ("data", "train", "model") for f in fields[s]}  # model's name first
                match = closest(key, owner)
                hint = f" (did you mean {owner[match]}.{match}?)" if match else ""
                raise UserError(f"override {item!r}: no section has a field {key!r}{hint}; write section.field=value")
            section, name = (owners[0] if owners else bare_section), key
        if section not in fields:
            raise UserError(
                f"override {item!r} names unknown section {section!r}{did_you_mean(section, fields)}; "
                "use model., data. or train."
            )
        (model_changes if section == "model" else out.setdefault(section, {}))[name] = value
        if section == "train" and name in BUDGET_FIELDS and value is not None:
            budgets[name] = item
    if len(budgets) > 1:
        raise UserError(f"overrides {' and '.join(budgets.values())} both set the training budget; keep one")
    for name in budgets:  # the override's budget replaces the config's, whichever kind each is
        for other in BUDGET_FIELDS:
            if other != name:
                out["train"].pop(other, None)
    if model_changes:
        out["model"] = ModelConfig.overridden(out.get("model", {}), model_changes)
    return out


def load_run_config(source: str | None, overrides: list[str]) -> RunConfig:
    """Preset name or YAML file (or nothing) plus overrides -> a validated RunConfig."""
    data = read_yaml(source) if source else {}
    return RunConfig.from_dict(apply_overrides(data, overrides))
