"""`asyncckpt.transformers` is `asyncckpt.doors.transformers` (the import path users know)."""

import sys

from .doors import transformers as _door

sys.modules[__name__] = _door
