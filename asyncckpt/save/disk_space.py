"""A warning before `keep_last=None` fills the disk.

Keeping every checkpoint is the default (nothing is deleted unasked), and a run that saves often
fills a disk quickly (32 GB in 70 s, saving a large state every 3 steps). After each commit into
a local root with no `keep_last`, the free space is compared with the newest checkpoint's size:
once fewer than `SAVES_LEFT` more saves of that size fit, one WARNING says so (once per
checkpointer). Object stores have no free space to speak of: nothing is checked there.
"""

from __future__ import annotations

import logging
import shutil
from typing import Optional

from ..storage import is_remote

log = logging.getLogger("asyncckpt")

SAVES_LEFT = 10  # warn when fewer saves of the newest checkpoint's size fit in the free space


class DiskSpaceWarning:
    """Warns once when a root that keeps every checkpoint is about to fill its disk."""

    def __init__(self) -> None:
        self.warned = False

    def after_commit(self, root: Optional[str], checkpoint_bytes: int) -> None:
        if self.warned or root is None or is_remote(root) or checkpoint_bytes <= 0:
            return
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            return
        if free >= SAVES_LEFT * checkpoint_bytes:
            return
        self.warned = True
        log.warning(
            "keep_last=None keeps every checkpoint of %s: %.1f GB free on its disk, room for about %d more "
            "checkpoints of %.2f GB; set CheckpointConfig(keep_last=N) to remove older ones",
            root, free / 1e9, free // checkpoint_bytes, checkpoint_bytes / 1e9,
        )
