"""The drop-ins: `async_save` for torch DCP / torchtitan, Lightning's CheckpointIO, the Transformers Trainer."""
