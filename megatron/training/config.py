"""The home of every training-side default that megatron-core's own config dataclasses lack.

Flags whose meaning is a megatron-core field (``TransformerConfig``, ``OptimizerConfig``,
``DistributedDataParallelConfig``) read their default from that field; the rest read it from the
dataclasses here. Defaults follow Megatron-LM's ``arguments.py``; where one differs, its docstring
says why.
"""

import importlib.util
from dataclasses import dataclass, field
from typing import Literal, Optional


def _default_transformer_impl() -> str:
    # Megatron-LM defaults to transformer_engine; without TE installed that default could only
    # fail, so the local spec is the default there (an explicit transformer_engine still errors).
    return "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"


@dataclass
class ModelArgs:
    """Model flags that are not ``TransformerConfig`` fields (or differ in meaning)."""

    seq_length: Optional[int] = None
    """Tokens per sample (required)."""
    max_position_embeddings: Optional[int] = None
    """Positions of a learned embedding; defaults to --seq-length."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """Kind of position embedding."""
    rotary_base: int = 10000
    """RoPE base period."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates."""
    squared_relu: bool = False
    """Squared ReLU activation in the MLP (instead of GeLU; not with --swiglu)."""
    transformer_impl: Literal["local", "transformer_engine"] = field(
        default_factory=_default_transformer_impl
    )
    """Layer implementation: megatron-core's local modules or Transformer Engine's."""
    swiglu: bool = False
    """Gated SiLU MLP (gated_linear_unit + silu)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of the input embedding's transpose."""
    disable_bias_linear: bool = False
    """No bias in linear layers."""
    group_query_attention: bool = False
    """Use --num-query-groups key/value groups."""
    vocab_size: Optional[int] = None
    """Vocabulary size for NullTokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the TP size."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual stage: interleaved 1F1B when set."""
    fp8_format: Optional[str] = None
    """FP8 training (not supported by this stack: a value is refused)."""


@dataclass
class TrainingArgs:
    """Batch, schedule and run flags."""

    micro_batch_size: Optional[int] = None
    """Samples per micro-batch per DP rank (required)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step; defaults to micro batch x DP (no accumulation)."""
    rampup_batch_size: Optional[list] = None
    """start increment samples: grow the global batch from start by increment over samples
    (sample-based training only, as Megatron-LM)."""
    train_iters: Optional[int] = None
    """Optimizer steps to train (this or --train-samples is required)."""
    train_samples: Optional[int] = None
    """Samples to train on (sample-based training: the lr flags in samples too)."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Learning-rate decay after warm-up."""
    lr_decay_iters: Optional[int] = None
    """Steps to decay over; defaults to --train-iters."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps."""
    lr_warmup_fraction: Optional[float] = None
    """Warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."""
    lr_decay_samples: Optional[int] = None
    """Samples to decay over (sample-based); defaults to --train-samples."""
    lr_warmup_samples: int = 0
    """Linear warm-up samples (sample-based)."""
    lr_wsd_decay_samples: Optional[int] = None
    """Samples of WSD's final decay phase (sample-based)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warm-up."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Decay shape of WSD's final phase."""
    lr_wsd_decay_iters: Optional[int] = None
    """Steps of WSD's final decay phase."""
    start_weight_decay: Optional[float] = None
    """Weight decay at step 0; defaults to --weight-decay."""
    end_weight_decay: Optional[float] = None
    """Weight decay at the end; defaults to --weight-decay."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from start to end."""
    seed: int = 1234
    """Random seed (model init, dropout, data shuffling)."""
    exit_interval: Optional[int] = None
    """Stop (after saving) when the iteration is a multiple of this."""
    exit_duration_in_mins: Optional[float] = None
    """Stop (after saving) once this many minutes have passed since the process started
    (Megatron-LM takes whole minutes; a fraction is accepted too)."""
    exit_signal_handler: bool = False
    """On --exit-signal (SIGTERM, as Slurm sends before a time limit or preemption): finish the
    step, save, exit 0."""
    exit_signal: str = "SIGTERM"
    """The signal --exit-signal-handler catches: a name or a number."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop with an error naming the iteration when a loss or gradient is NaN/inf (before the
    optimizer step, so no NaN weights are applied or saved)."""


@dataclass
class DataArgs:
    """Data and tokenizer flags (functions in datasets.py / tokenizer.py do the work)."""

    data_path: Optional[list] = None
    """Prefixes, optionally weighted: ``p`` | ``pA pB`` | ``wA pA wB pB``."""
    split: Optional[str] = None
    """train,valid,test proportions; Megatron-LM's 969,30,1 when a --data-path is given."""
    mock_data: bool = False
    """Synthetic data (smoke runs)."""
    tokenizer_type: Optional[str] = None
    """ByteLevelTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer | NullTokenizer."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer vocab.json."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer merges.txt."""
    tokenizer_model: Optional[str] = None
    """HuggingFaceTokenizer tokenizer.json (or its folder)."""
    data_cache_path: Optional[str] = None
    """Where dataset index caches go (default: beside the data)."""
    train_data_path: Optional[list] = None
    """Training split's prefixes (optionally weighted); instead of --data-path and --split."""
    valid_data_path: Optional[list] = None
    """Validation split's prefixes (optionally weighted)."""
    test_data_path: Optional[list] = None
    """Test split's prefixes (optionally weighted)."""
    mmap_bin_files: bool = True
    """Memory-map the .bin token files (--no-mmap-bin-files reads them instead)."""
    create_attention_mask_in_dataloader: bool = False
    """Build a [s, s] attention mask per sample. Megatron-LM defaults to True; our models use
    causal masks, so the mask would cost memory and broadcast time for nothing (off here)."""
    dataloader_type: Optional[Literal["single", "cyclic", "external"]] = None
    """single (ours: Megatron's pretraining sampler, resumable by consumed samples; the
    default); cyclic and external are refused."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""


@dataclass
class CheckpointArgs:
    """Save and resume flags."""

    save: Optional[str] = None
    """Folder to save checkpoints in."""
    load: Optional[str] = None
    """Folder to resume from (its latest_checkpointed_iteration.txt)."""
    save_interval: Optional[int] = None
    """Steps between saves; a final save happens at the end whenever --save is given."""
    ckpt_format: Literal["torch_dist", "torch"] = "torch_dist"
    """torch_dist: sharded (dist_checkpointing); torch: one file per model-parallel rank."""
    no_load_optim: bool = False
    """Resume without optimizer state (fresh optimizer)."""
    no_load_rng: bool = False
    """Resume without the RNG states."""
    no_save_optim: bool = False
    """Save without optimizer state (Megatron-LM's default is None, meaning the same)."""
    no_save_rng: bool = False
    """Save without the RNG states."""
    finetune: bool = False
    """Load weights only; start at iteration 0 with fresh optimizer and RNG."""


@dataclass
class LoggingArgs:
    """Logging and evaluation flags."""

    log_interval: int = 100
    """Steps between console log lines."""
    eval_interval: int = 1000
    """Steps between validation evaluations."""
    eval_iters: int = 100
    """Global batches per evaluation (0: no evaluation)."""
    full_validation: bool = False
    """Every evaluation reads the whole validation split, the same samples each time (one epoch,
    cut to whole global batches); --eval-iters is then set from the split's size."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars here (needs the tensorboard package)."""
    log_throughput: bool = False
    """Add tokens/s per GPU to the log line."""
    log_params_norm: bool = False
    """Add the L2 norm of the model's params to the log line (a collective per log line)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write validation perplexity to TensorBoard."""
