"""`asyncckpt.torch_dcp` is `asyncckpt.doors.torch_dcp` (the import path users know)."""

import sys

from .doors import torch_dcp as _door

sys.modules[__name__] = _door
