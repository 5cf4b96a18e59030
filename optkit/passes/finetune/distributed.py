"""Moved to :mod:`optkit.runtime.distributed`; this name stays until the fine-tune loop imports it from there."""

from optkit.runtime.distributed import (all_finite, all_reduce_sum, broadcast_buffers, init_distributed,
                                        is_main_process, launch_rank, rank_and_world, wrap_ddp)

__all__ = ["all_finite", "all_reduce_sum", "broadcast_buffers", "init_distributed", "is_main_process",
           "launch_rank", "rank_and_world", "wrap_ddp"]
