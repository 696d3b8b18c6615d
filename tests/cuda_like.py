"""Make a DTensor behave on CPU as it does where CUDA is present: raw tensor operations on the
wrapper fail instead of quietly answering.

With CUDA available, `DTensor.is_pinned()` raises NotImplementedError ("does not have a sharding
strategy registered"), and a DTensor's storage / data pointer are not its data's anywhere. On a
CPU-only machine `is_pinned()` answers False without asking the DTensor, so a bug that crashes
every GPU job passed CPU CI. Every pytest process and every spawned rank of the suite calls
`dtensor_as_on_cuda()` (conftest.py, multirank.py), so the suite catches such a bug on CPU.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

RAW_OPS = ("is_pinned", "pin_memory", "untyped_storage", "data_ptr", "is_shared", "share_memory_")


def _refuse(name: str):
    def raw_op(self, *args, **kwargs):
        raise NotImplementedError(
            f"DTensor.{name}(): a raw tensor operation on the wrapper (where CUDA is present torch raises "
            f"'Operator aten.{name}.default does not have a sharding strategy registered'); use .to_local()"
        )

    raw_op.__name__ = name
    return raw_op


def dtensor_as_on_cuda() -> None:
    """Patch DTensor's raw operations to raise (idempotent; the process's own DTensor class)."""
    for name in RAW_OPS:
        if name not in DTensor.__dict__:  # DTensor defines none of them itself
            setattr(DTensor, name, _refuse(name))
