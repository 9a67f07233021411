"""Head registry: a new head is one file in `heads/` plus one line here."""

from __future__ import annotations

from tango_lm.heads.standard import StandardHead

HEADS = {
    "standard": StandardHead,
}
