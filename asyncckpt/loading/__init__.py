"""Loading a checkpoint: safely (restricted unpickling, checked paths and ranges), in parallel, every item's checksum checked."""
