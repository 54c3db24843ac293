"""Process groups and tensor-parallel layers. Model files import the layers from here: this is the one seam."""
from accessory.parallel.context import (ParallelContext, fairscale_model_parallel_group, init_distributed,
                                        share_cores, shutdown_distributed)
from accessory.parallel.layers import (ColumnParallelLinear, ExpertLinear, ExpertPlacement, FusedColumns,
                                       HeadPlacement, ParallelEmbedding, RowParallelLinear, Shard,
                                       expert_placement, global_shape, head_placement, head_shard, make_shard,
                                       shard_of)
from accessory.parallel.lora import (AdapterRouting, LoraColumnParallelLinear, LoraFactors, LoraRowParallelLinear,
                                     ReplicatedLinear)

__all__ = ["ParallelContext", "fairscale_model_parallel_group", "init_distributed", "shutdown_distributed",
           "share_cores",
           "ColumnParallelLinear",
           "RowParallelLinear", "FusedColumns", "ParallelEmbedding", "Shard", "make_shard", "shard_of", "global_shape",
           "LoraColumnParallelLinear", "LoraRowParallelLinear", "ReplicatedLinear", "AdapterRouting", "LoraFactors",
           "ExpertLinear", "ExpertPlacement", "expert_placement", "HeadPlacement", "head_placement", "head_shard"]
