"""--pipeline-model-parallel-layout: every pipeline stage's layers spelt out, checked as
Megatron-LM checks it, with errors that name the flag.

A layout such as ``"E|(tt|)*2,tL"`` lists the stages in order, ``|`` between them: ``E`` the
embedding, ``t`` a transformer layer, ``m`` a Multi-Token Prediction layer, ``L`` the loss
(output layer); ``(...)*n`` and ``x*n`` repeat, commas are cosmetic. With PP ranks and
``k * PP`` stages, stage ``i`` lives on rank ``i % PP`` as its virtual stage ``i // PP``: more
stages than ranks give an interleaved pipeline. megatron-core 0.16.1 builds it from
``TransformerConfig.pipeline_model_parallel_layout`` (``PipelineParallelLayerLayout``); these
rules run its parser and checks first, so that a bad layout is refused before any process group
exists and the message names the flag rather than a config field.
"""

from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

FLAG = "--pipeline-model-parallel-layout"
_VIRTUAL = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")
_SPLIT = (
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
)
# megatron-core's parser and checks assert (or index an empty layout); their text is kept.
_CORE_ERRORS = (AssertionError, IndexError, NotImplementedError, ValueError)


def given(a) -> bool:
    """Whether the layout flag is set."""
    return a.pipeline_model_parallel_layout is not None


def _set(a, flags) -> list[str]:
    return [f for f in flags if getattr(a, f[2:].replace("-", "_")) not in (None, False)]


def num_stages(a) -> int:
    """Pipeline stages the layout lists (PP ranks times virtual stages)."""
    return len(PipelineParallelLayerLayout.parse_str_to_list(a.pipeline_model_parallel_layout))


def virtual_size(a):
    """Model chunks per pipeline rank the layout gives, None for one (no interleaving)."""
    size = num_stages(a) // a.pipeline_model_parallel_size
    return size if size > 1 else None


def parsed(a) -> PipelineParallelLayerLayout:
    """megatron-core's layout object for this run (after ``RULES`` passed)."""
    return PipelineParallelLayerLayout(
        a.pipeline_model_parallel_layout, a.pipeline_model_parallel_size
    )


def _core_error(a) -> str | None:
    """megatron-core's own complaint about the layout, None where it accepts it."""
    try:
        layout = parsed(a)
        if layout.validate_layer_layout(a.num_layers, a.mtp_num_layers):
            return "a Multi-Token Prediction layer (m) off the last pipeline rank is not run here"
    except _CORE_ERRORS as err:
        return str(err) or type(err).__name__
    return None


def _stage_count_error(a) -> str | None:
    try:
        count = num_stages(a)
    except _CORE_ERRORS as err:
        return str(err)
    if count % a.pipeline_model_parallel_size:
        return (
            f"lists {count} stage(s): must be a multiple of --pipeline-model-parallel-size "
            f"({a.pipeline_model_parallel_size}), one or more virtual stages per rank"
        )
    if count > a.pipeline_model_parallel_size == 1:
        return f"lists {count} stages: a virtual pipeline needs --pipeline-model-parallel-size >= 2"
    return None


def _refuse(a, why: str) -> str:
    return f"{FLAG} {a.pipeline_model_parallel_layout!r}: {why}"


RULES = (  # checked only where the layout is given, in this order
    (
        lambda a: _set(a, _VIRTUAL),
        lambda a: f"{FLAG} and {', '.join(_set(a, _VIRTUAL))} both set the virtual pipeline: "
        "give one (as Megatron-LM; the layout's stage count sets it)",
    ),
    (
        lambda a: _set(a, _SPLIT),
        lambda a: f"{FLAG} and {', '.join(_set(a, _SPLIT))} both split the layers over the "
        "stages: give one (as megatron-core)",
    ),
    (lambda a: _stage_count_error(a), lambda a: _refuse(a, _stage_count_error(a))),
    (
        lambda a: _core_error(a),
        lambda a: _refuse(a, _core_error(a))
        + f" (--num-layers {a.num_layers}, --mtp-num-layers {a.mtp_num_layers}; "
        "E first, L last, each once)",
    ),
)


def notice(a) -> str:
    """The start-up line: what each pipeline rank holds (megatron-core's table of the layout)."""
    return f"{FLAG} places the layers per pipeline rank:\n{parsed(a).pretty_repr()}"
