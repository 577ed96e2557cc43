"""How the transformer layers are split over pipeline stages, checked as Megatron-LM's flags say.

Even: ``--num-layers`` (plus one for the embedding and one for the loss where
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` count
them as layers) divides by ``--pipeline-model-parallel-size``. Uneven:
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the first
and last stages and the middle stages share the rest evenly. megatron-core builds the stages
(``TransformerConfig.num_layers_in_first_pipeline_stage`` ...); these rules name the flags
before its own checks, which name only fields, are reached.
"""


def split_layers(a) -> int:
    """Layers the even split divides: transformer layers plus the counted embedding and loss."""
    counted = a.account_for_embedding_in_pipeline_split + a.account_for_loss_in_pipeline_split
    return a.num_layers + counted


def uneven(a) -> bool:
    """Whether the first or last stage's layer count is given."""
    return a.decoder_first_pipeline_num_layers is not None or (
        a.decoder_last_pipeline_num_layers is not None
    )


def _ends(a) -> list[int]:
    ends = (a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers)
    return [n for n in ends if n is not None]


def middle(a) -> tuple[int, int]:
    """(layers, stages) between the given first and last stages."""
    ends = _ends(a)
    return a.num_layers - sum(ends), a.pipeline_model_parallel_size - len(ends)


def _bad_middle(a) -> bool:
    layers, stages = middle(a)
    return layers < 0 or bool(layers) != bool(stages) or bool(stages and layers % stages)


def _even_what(a) -> str:
    counted = [
        name
        for name, on in (
            ("the embedding", a.account_for_embedding_in_pipeline_split),
            ("the loss", a.account_for_loss_in_pipeline_split),
        )
        if on
    ]
    plus = f" plus {' and '.join(counted)} ({split_layers(a)})" if counted else ""
    return f"--num-layers ({a.num_layers}){plus}"


_UNEVEN = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"

RULES = (
    (
        lambda a: not uneven(a)
        and a.pipeline_model_parallel_layout is None  # the layout places every layer itself
        and split_layers(a) % a.pipeline_model_parallel_size,
        lambda a: f"{_even_what(a)} must be divisible by --pipeline-model-parallel-size "
        f"({a.pipeline_model_parallel_size}), or set {_UNEVEN}",
    ),
    (
        lambda a: uneven(a) and a.pipeline_model_parallel_size < 2,
        lambda a: f"{_UNEVEN} need --pipeline-model-parallel-size >= 2",
    ),
    (
        lambda a: any(n < 1 for n in _ends(a)),
        lambda a: f"{_UNEVEN} must be >= 1, got {_ends(a)}",
    ),
    (
        lambda a: uneven(a) and split_layers(a) != a.num_layers,
        lambda a: f"{_UNEVEN} and --account-for-embedding-in-pipeline-split / "
        "--account-for-loss-in-pipeline-split are exclusive (as in Megatron-LM)",
    ),
    (
        lambda a: uneven(a) and _bad_middle(a),
        lambda a: f"--num-layers ({a.num_layers}) minus {_UNEVEN} ({_ends(a)}) leaves "
        f"{middle(a)[0]} layer(s) for {middle(a)[1]} middle stage(s): each middle stage needs "
        "an equal share, at least one layer (none when there is no middle stage)",
    ),
)


def per_stage(a) -> int:
    """Layers of an evenly split stage (``--num-layers-per-virtual-pipeline-stage`` divides it)."""
    return split_layers(a) // a.pipeline_model_parallel_size


VPP_RULES = (
    (
        lambda a: uneven(a),
        lambda a: f"{_UNEVEN} with a virtual pipeline: give --num-virtual-stages-per-pipeline-rank "
        "instead of --num-layers-per-virtual-pipeline-stage (as Megatron-LM)",
    ),
)


def stage_counts(a) -> list[int]:
    """Layers on each uneven pipeline stage, first to last (what a virtual degree must divide)."""
    layers, stages = middle(a)
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    counts = [] if first is None else [first]
    counts += [layers // stages] * stages if stages else []
    return counts + ([] if last is None else [last])


_STAGES = "--num-virtual-stages-per-pipeline-rank"

VIRTUAL_STAGES_RULES = (
    (
        lambda a: a.num_layers_per_virtual_pipeline_stage is not None,
        lambda a: f"--num-layers-per-virtual-pipeline-stage and {_STAGES} both set the virtual "
        "pipeline: give one (as Megatron-LM)",
    ),
    (
        lambda a: a.num_virtual_stages_per_pipeline_rank < 1 or a.pipeline_model_parallel_size < 2,
        lambda a: f"{_STAGES} ({a.num_virtual_stages_per_pipeline_rank}) must be >= 1 and needs "
        "--pipeline-model-parallel-size >= 2",
    ),
    (
        lambda a: uneven(a)
        and any(n % a.num_virtual_stages_per_pipeline_rank for n in stage_counts(a)),
        lambda a: f"{_STAGES} ({a.num_virtual_stages_per_pipeline_rank}) must divide the layers "
        f"of every pipeline stage ({stage_counts(a)}, from {_UNEVEN})",
    ),
    (
        lambda a: not uneven(a) and per_stage(a) % a.num_virtual_stages_per_pipeline_rank,
        lambda a: f"{_STAGES} ({a.num_virtual_stages_per_pipeline_rank}) must divide the layers "
        f"per pipeline stage ({per_stage(a)})",
    ),
)
