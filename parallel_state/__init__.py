"""The process grid (pp x dp x tp on one DeviceMesh), its getters, the TP-aware RNG tracker,
the collectives with autograd, pipeline p2p and the one layer every collective passes through.
See grid.py, random.py, mappings.py, p2p.py and collectives.py; hang_doctor/ (the collective
trace, its report, --debug-collectives: consumers of collectives.py) and transport/ (the
shared-memory channel collectives.py runs CPU groups on, and its set-up)."""
from . import collectives  # noqa: F401
from .grid import (  # noqa: F401
    Grid,
    GridError,
    default_device,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_device,
    get_embedding_group,
    get_stage_group,
    get_grid,
    get_model_parallel_group,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    initialize_distributed,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    model_parallel_is_initialized,
    report_error,
    set_virtual_pipeline_model_parallel_rank,
)
from .mappings import (  # noqa: F401
    all_reduce_sequence_parallel_grads,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .random import (  # noqa: F401
    DEFAULT_RNG,
    DROPOUT_MASKS,
    MODEL_PARALLEL_RNG,
    dropout_sample_ids,
    get_dropout_sample_ids,
    get_dropout_seed,
    get_rng_tracker,
    model_parallel_seed,
)
