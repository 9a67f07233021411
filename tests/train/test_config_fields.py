"""Every train field is sorted into what a run computes or how it runs: the sweep (sweep/runner.py)
retrains a finished run and the report (eval/report_runs.py) splits its rows on the first kind only,
so a new field must be placed before either can treat it right."""

from __future__ import annotations

import dataclasses

from tango_lm.models.config import MODEL_LOGISTICS_FIELDS, ModelConfig
from tango_lm.train.config import BUDGET_FIELDS, LOGISTICS_FIELDS, TrainConfig
from tango_lm.train.resume import SAME_ON_RESUME, SCHEDULE

# Train fields that change what a run computes: its numbers differ when one does.
COMPUTES = {
    "seed", "data_seed", "reshuffle_each_epoch", "seq_len", "batch_size", "grad_accum", "lr", "min_lr_ratio",
    "warmup_steps", "schedule", "decay_fraction", "weight_decay", "beta1", "beta2", "grad_clip", "eval_every",
    "eval_windows", "eval_sample_seed", "test_windows", "eval_batch_size", "select", "precision",
}  # fmt: skip


def test_every_train_field_is_a_budget_logistics_or_what_a_run_computes():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kinds = {"BUDGET_FIELDS": set(BUDGET_FIELDS), "LOGISTICS_FIELDS": set(LOGISTICS_FIELDS), "COMPUTES": COMPUTES}
    for name in sorted(names):
        placed = [kind for kind, fields in kinds.items() if name in fields]
        assert len(placed) == 1, (
            f"train.{name} is in {placed or 'none'} of {list(kinds)}: add it to train/config.py's LOGISTICS_FIELDS "
            "if it does not change what a run computes, or to this test's COMPUTES if it does"
        )
    assert set().union(*kinds.values()) == names, "a listed field that TrainConfig does not have"


def test_the_resume_and_model_lists_name_fields_that_exist():
    # A misspelt name in one of these lists is a check that never runs.
    train = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(SAME_ON_RESUME) <= train and set(SCHEDULE) <= train
    assert MODEL_LOGISTICS_FIELDS <= {f.name for f in dataclasses.fields(ModelConfig)}
