"""Head registry: a new head is one file in `heads/` plus one line here."""

from __future__ import annotations

from tango_lm.heads.factorial import FactorialAA, FactorialAMix, FactorialMA, FactorialMMix
from tango_lm.heads.input_gate import InputGateHead
from tango_lm.heads.mos import MosHead, MossHead, SigsoftmaxHead
from tango_lm.heads.onona import OnonaHead
from tango_lm.heads.standard import StandardHead
from tango_lm.heads.untied import UntiedHead

HEADS = {
    "standard": StandardHead,
    "untied": UntiedHead,
    "onona": OnonaHead,
    "mos": MosHead,
    "sigsoftmax": SigsoftmaxHead,
    "moss": MossHead,
    "input-gate": InputGateHead,
    "factorial-a-a": FactorialAA,
    "factorial-a-mix": FactorialAMix,
    "factorial-m-a": FactorialMA,
    "factorial-m-mix": FactorialMMix,  # the M-input, mixture-output cell is onóna itself
}
