"""`asyncckpt.lightning` is `asyncckpt.doors.lightning` (the import path users know)."""

import sys

from .doors import lightning as _door

sys.modules[__name__] = _door
