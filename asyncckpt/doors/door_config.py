"""The one rule every door applies to the CheckpointConfig it is given."""

from __future__ import annotations

from ..config import CheckpointConfig


def check_door_config(config: CheckpointConfig, door: str, keeps: str, error: type[Exception] = ValueError) -> None:
    """A door's caller names every directory (so `keep_last`, which keeps `ROOT/step_N`
    checkpoints, does not apply: `keeps` says what decides instead), and changes the state right
    after the save returns (so staging must be eager: a lazy copy would hold later values)."""
    if not isinstance(config, CheckpointConfig):
        raise TypeError(f"config must be a CheckpointConfig, not {type(config).__name__}")
    if config.keep_last is not None:
        raise error(f"{door} does not use CheckpointConfig.keep_last: {keeps} decides what is kept")
    if config.staging != "eager":
        raise error(f"{door} needs CheckpointConfig.staging='eager' (staging='lazy' does not apply): its caller "
                    "changes the state right after the save returns, before a lazy copy would end")
