"""`pick_device`: a device this machine cannot run is a one-line UserError naming the setting to change."""

from __future__ import annotations

import pytest
import torch

from tango_lm.errors import UserError
from tango_lm.train.device import pick_device


def test_auto_takes_cuda_then_mps_then_the_cpu(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == torch.device("cuda")


def test_unavailable_devices_say_what_to_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match="CUDA is not available; use --device cpu"):
        pick_device("cuda")
    with pytest.raises(UserError, match="CUDA is not available; use train.device=cpu"):
        pick_device("cuda:0", "train.device")
    with pytest.raises(UserError, match=r"MPS \(Apple's GPU\) is not available; use train.device=cpu"):
        pick_device("mps", "train.device")
    for name in ("meta", "xpu"):  # torch knows them; nothing here runs on them
        with pytest.raises(UserError, match="is not supported; use auto, cpu, cuda, cuda:N or mps"):
            pick_device(name)
    with pytest.raises(UserError, match="unknown device 'tpu9'"):
        pick_device("tpu9")


def test_a_cuda_index_past_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UserError, match="'cuda:2' does not exist: 2 CUDA device"):
        pick_device("cuda:2")
