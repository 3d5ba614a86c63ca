"""Beyond one device: ``torch.distributed`` launched by ``torchrun``.

- :mod:`.group`: process groups from torchrun's environment (NCCL on CUDA,
  Gloo on CPU), this process's ranks, the collectives specdec uses;
- :mod:`.tensor_parallel`: a registered decoder split across ranks by its
  class's ``tp_plan``, each rank loading only its shard;
- :mod:`.replicas`: data-parallel replicas of a speculative pipeline in one process;
- :mod:`.data_parallel`: prompts sharded across processes, results merged on rank 0.
"""

from specdec.dist.group import DistContext, DistError, current, init_from_env, shutdown

__all__ = ["DistContext", "DistError", "current", "init_from_env", "shutdown"]
