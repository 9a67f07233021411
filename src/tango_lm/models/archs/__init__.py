"""One file per architecture family; `tango_lm.models.registry` maps config names to them."""
