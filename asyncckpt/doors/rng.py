"""Every global random generator's state as tensors: saved with the rest of a training state,
they load with `weights_only` (no pickled NumPy arrays), per rank, and in place like any tensor.

    state["rng"] = rng_state()            # at save time
    load(state, path); set_rng_state(state["rng"])   # at resume
"""

from __future__ import annotations

import logging
import random
from typing import Optional

import numpy as np
import torch

from ..errors import CheckpointError

log = logging.getLogger("asyncckpt")


def rng_state(cuda: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """Python's, NumPy's, torch's CPU and each CUDA device's generator states. CUDA's by default
    only where this process has initialised CUDA: a CPU-only job on a machine with a GPU drew
    nothing from them, and reading them would create a CUDA context (GPU memory and seconds).
    `cuda=True` reads them anyway, e.g. as the template to load a checkpoint's CUDA states into."""
    version, keys, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    if np_name != "MT19937":
        raise CheckpointError(f"NumPy's global generator is {np_name}; only MT19937 can be saved")
    state = {
        "python": torch.tensor([version, *keys], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([np_pos, np_has_gauss, *np_keys.tolist()], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        "cpu": torch.random.get_rng_state(),
    }
    if (torch.cuda.is_initialized() if cuda is None else cuda) and torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    python = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    numpy = state["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(numpy[2:], dtype=np.uint32), numpy[0], numpy[1],
                         float(state["numpy_gauss"][0])))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        if len(saved) != torch.cuda.device_count():
            log.warning("the checkpoint holds %d CUDA generator states for %d devices now: CUDA "
                        "randomness will differ from the saved run", len(saved), torch.cuda.device_count())
        for device, device_state in enumerate(saved[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
