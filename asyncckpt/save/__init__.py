"""The trainer's side of a save: plan, snapshot, hand-over to the worker, agreement across ranks, commit, retention."""
