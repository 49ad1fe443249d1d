"""Building blocks of the decoder: norms, rotary, attention, MoE."""
