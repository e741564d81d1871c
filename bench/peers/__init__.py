"""This stack against TRL's GRPOTrainer, everything else held equal (``peer_trl``)."""
