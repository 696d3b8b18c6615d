"""The command line (`python -m asyncckpt`, the `asyncckpt` script) and the Hugging Face export."""

from .commands import main

__all__ = ["main"]
