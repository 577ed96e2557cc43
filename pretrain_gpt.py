"""Pretrain a GPT with megatron-core: Megatron-LM's pretrain_gpt.py, with Muon as an optimizer.

Launch (4 CPU ranks, TP=2 x DP=2, our Muon with the seed's recipe, DistributedOptimizer, the
built-in stdlib corpus; on upstream's loop, base megatron-core 0.19.2; examples/cpu_quickstart.sh
is the same, larger):
    CUDA_DEVICE_MAX_CONNECTIONS=1 .venv/bin/torchrun --nproc-per-node 4 --standalone \
        pretrain_gpt.py --tensor-model-parallel-size 2 --use-distributed-optimizer \
        --optimizer muon --muon-impl megatron_muon --muon-matched-adamw-rms 0.2 \
        --muon-nesterov --muon-momentum 0.95 --muon-coefficient-type simple \
        --muon-tp-mode duplicated --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 4 \
        --global-batch-size 16 --train-iters 50 --lr 3e-3 \
        --data-path $(.venv/bin/python -P -m megatron.training.corpus) --split 98,2,0 \
        --tokenizer-type NullTokenizer --vocab-size 257 --log-interval 5 --eval-interval 25 \
        --eval-iters 4 \
        --save /tmp/ckpt --save-interval 50 --distributed-backend gloo --transformer-impl local \
        --no-persist-layer-norm --no-gradient-accumulation-fusion --no-rope-fusion

Flags follow Megatron-LM (``--help`` lists them with their defaults); a bad flag exits 2 with a
message naming it, a checkpoint that does not fit exits 1; the rerun state machine exits 16
(resume to re-run a step) or 17 (a result failed validation), as Megatron-LM.
"""

import importlib.machinery
import os
import sys


def _installed_path() -> list:
    """sys.path less this script's folder: its megatron/training (our loop's source) shadows the
    installed megatron.training of a base that ships upstream's."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def _upstream_loop_installed() -> bool:
    spec = importlib.machinery.PathFinder.find_spec("megatron", _installed_path())
    places = (spec.submodule_search_locations or []) if spec else []
    return any(os.path.isfile(os.path.join(p, "training", "global_vars.py")) for p in places)


# Base megatron-core 0.19: upstream's own megatron.training (its pretrain()) runs the loop through
# megatron/training/gpt_entry.py. What follows this block is our loop's entry (base 0.16.1).
if _upstream_loop_installed():
    if __name__ != "__main__":
        raise ImportError("pretrain_gpt.py on upstream's loop: import megatron.training.gpt_entry")
    sys.path[:] = _installed_path()
    import runpy

    # As __main__: processes that multiprocessing spawns re-import it, not this file.
    runpy.run_module("megatron.training.gpt_entry", run_name="__main__", alter_sys=True)

import time  # noqa: E402
import warnings  # noqa: E402
from functools import partial  # noqa: E402

# Upstream warns about optional accelerated kernels (TE, Apex) at import; the fallbacks are fine.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) is not installed")
warnings.filterwarnings("ignore", message=".*Apex are not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")

import torch  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.utils import get_model_config  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.training import cpu_mode, data_check, datasets, rerun  # noqa: E402
from megatron.training.arguments import ArgumentsError, parse_args  # noqa: E402
from megatron.training.checkpointing import CheckpointError  # noqa: E402
from megatron.training.core_configs import transformer_config  # noqa: E402
from megatron.training.exit_conditions import ExitConditions  # noqa: E402
from megatron.training.failures import FailureBroadcast, TrainingError  # noqa: E402
from megatron.training.initialize import initialize  # noqa: E402
from megatron.training.timers import started  # noqa: E402
from megatron.training.tokenizer import build_tokenizer, padded_vocab_size  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402


def layer_spec(args, config):
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(**_spec_options(args))
    return get_gpt_layer_local_spec(**_spec_options(args), normalization=config.normalization)


def _spec_options(args) -> dict:
    return dict(
        num_experts=args.num_experts,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        qk_l2_norm=args.qk_l2_norm,
    )


def mtp_block_spec(args, config, spec, vp_stage=None):
    """--mtp-num-layers: Multi-Token Prediction layers after the decoder (built on the last
    pipeline stage only; None elsewhere and without the flag), as Megatron-LM's pretrain_gpt."""
    if args.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    te = args.transformer_impl == "transformer_engine"
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te, vp_stage=vp_stage)


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    spec = layer_spec(args, config)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_block_spec(args, config, spec, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )


def loss_func(args, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses over unmasked tokens, with the token count: the schedule divides
    by it, and the reported ``lm loss`` pair is reduced token-weighted over DP (Megatron-LM).
    The rank's loss goes through the rerun state machine's checks first (NaN/Inf, spiky)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    rerun.validate_loss(args, loss)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(args, data_iterator, model):
    # Megatron-LM's level-2 timer around reading the batch (none during evaluation)
    timer = started(get_model_config(model).timers, "batch-generator", 2)
    tokens, labels, loss_mask, attention_mask, position_ids = datasets.get_batch(
        data_iterator, args.micro_batch_size, args.seq_length, device=cpu_mode.device()
    )
    timer.stop()
    # loss_mask: the MTP layers' losses skip the masked tokens too (unused without MTP)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, args, loss_mask)


def dataset_config(args, tokenizer):
    """pretrain_gpt.py's GPTDatasetConfig from the data flags."""
    return datasets.gpt_dataset_config(
        tokenizer,
        args.seq_length,
        seed=args.seed,
        data_path=args.data_path,
        split=args.split,
        mock_data=args.mock_data,
        data_cache_path=args.data_cache_path,
        train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path,
        mmap_bin_files=args.mmap_bin_files,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        sequences_per_dataset=_sequences_per_dataset(args),
    )


def _sequences_per_dataset(args):
    if args.per_dataset_sequences_path is None:
        return None
    from megatron.training.data_args_files import read_sequences_per_dataset

    return read_sequences_per_dataset(args.per_dataset_sequences_path)  # checked at start-up


def data_iterators(args, state, n_chunks, tokenizer):
    """(train, valid, test) iterators (lists for virtual stages; None on ranks that read no
    data): train and valid from the consumed-sample counts, test from its start (Megatron-LM
    evaluates it once, after training). valid/test are False on every rank where no rank has
    that split."""
    config = dataset_config(args, tokenizer)
    samples = datasets.train_valid_test_num_samples(
        args.train_iters,
        args.global_batch_size,
        args.eval_interval,
        args.eval_iters,
        train_samples=args.train_samples,
        full_validation=args.full_validation,
    )
    try:
        train_ds, valid_ds, test_ds = datasets.build_train_valid_test_datasets(config, samples)
    except ValueError as err:  # the data flags do not fit (empty split, missing prefix...)
        raise ArgumentsError(str(err)) from err
    if args.full_validation:
        valid_ds = _whole_validation_passes(args, valid_ds)
    train, valid, test = [], [], []
    # --full-validation reads the split in order whatever the type (Megatron-LM's choice too)
    valid_type = "single" if args.full_validation else args.dataloader_type
    for _ in range(n_chunks):
        train.append(_loader(args, train_ds, state.consumed_train_samples, args.dataloader_type))
        # --skip-train: every checkpoint scored on the same batches, as Megatron-LM
        valid_from = 0 if args.skip_train else state.consumed_valid_samples
        valid.append(_loader(args, valid_ds, valid_from, valid_type, True))
        test.append(_loader(args, test_ds, 0, valid_type, True))
    has_valid, has_test = _any_rank(valid_ds is not None, test_ds is not None)
    return (
        _one_or_list(train),
        _one_or_list(valid) if has_valid else False,
        _one_or_list(test) if has_test else False,
    )


def _whole_validation_passes(args, valid_ds):
    """--full-validation: one epoch of the validation split cut to whole global batches, and
    --eval-iters set to their count on every rank (readers tell the others), so that each
    evaluation reads exactly this set, in the same order (the cyclic loader restarts at its end).
    """
    batches = len(valid_ds) // args.global_batch_size if valid_ds is not None else 0
    value = torch.tensor([batches], device=cpu_mode.device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    args.eval_iters = int(value.item())
    if args.eval_iters == 0 and args.eval_interval:
        raise ArgumentsError(
            f"--full-validation: the validation split holds fewer samples than one global batch "
            f"(--global-batch-size {args.global_batch_size}): give it a larger --split share"
        )
    if valid_ds is None:
        return None
    return torch.utils.data.Subset(valid_ds, range(batches * args.global_batch_size))


def _any_rank(*flags: bool) -> tuple:
    """Ranks that read no data (TP > 0, middle stages) learn from the readers whether the
    validation and test splits exist, so that every rank evaluates one or none does."""
    value = torch.tensor([int(flag) for flag in flags], device=cpu_mode.device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return tuple(bool(v) for v in value.tolist())


def _loader(args, dataset, consumed, dataloader_type, cyclic=False):
    """An iterator over ``dataset`` from ``consumed`` samples on. single: the sequential
    sampler, restarted at its end for validation only; cyclic: Megatron-LM's random sampler,
    restarted (next epoch, new permutation) for training and validation alike."""
    if dataset is None:
        return None
    if dataloader_type == "single":
        consumed %= len(dataset)
    loader = datasets.build_pretraining_data_loader(
        dataset,
        consumed,
        args.micro_batch_size,
        num_workers=args.num_workers,
        dataloader_type=dataloader_type,
        data_sharding=args.data_sharding,
    )
    # Creating a DataLoader iterator draws a worker seed from the loader's generator, by default
    # torch's global one. On CPU that generator also drives dropout, which must stay identical
    # across TP ranks (only TP rank 0 has a loader) and across a resume: give the loader its own.
    loader.generator = torch.Generator().manual_seed(args.seed)
    first = iter(loader)
    return _cycle(loader, first) if cyclic or dataloader_type == "cyclic" else first


def _cycle(loader, first):
    yield from first
    yield from datasets.cyclic_iter(loader)


def _one_or_list(items):
    return items[0] if len(items) == 1 else items


def main(argv=None) -> int:
    start_time = time.time()  # --exit-duration-in-mins counts start-up, as Megatron-LM
    try:
        args = parse_args(argv)
    except ArgumentsError as err:
        _print_error(f"pretrain_gpt.py: error: {err}")
        return 2
    _print_notices(args)
    exit_conditions = ExitConditions(args, start_time)  # catches a signal sent during start-up
    try:
        data_check.check_data(args)  # before any process group or model exists
    except data_check.DataError as err:  # each rank checks its own view of the files
        print(f"{_where()}: error: {err}", file=sys.stderr, flush=True)
        return 1
    try:
        tokenizer = tokenizer_from_args(args)  # its files read before any process group
    except (ValueError, NotImplementedError, ImportError) as err:
        print(f"{_where()}: error: {err}", file=sys.stderr, flush=True)
        return 1
    initialize(args)
    guard = FailureBroadcast("pretrain_gpt.py").start()
    try:
        code = train(args, exit_conditions, tokenizer)
    except Exception as err:  # every failing rank says why, the others stop naming it
        label, code = _classify(err)
        guard.fail_with(err, label, expected=code is not None)
        if guard.world > 1:  # leave now: launchers name the first rank to exit as the cause
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 1)
        return code or 1
    guard.stop()
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return code


def tokenizer_from_args(args):
    """The tokenizer of the tokenizer flags; a bad file or value is a ValueError naming it. A
    tokenizer that cannot end documents (no eod) is refused too: GPTDataset needs one."""
    tokenizer = build_tokenizer(
        args.tokenizer_type,
        args.vocab_file,
        args.merge_file,
        args.tokenizer_model,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
        vocab_extra_ids=args.vocab_extra_ids,
    )
    tokenizer.eod  # noqa: B018 -- NotImplementedError naming what is missing
    return tokenizer


def train(args, exit_conditions, tokenizer) -> int:
    """Train; the process's exit code (0, or the rerun state machine's 16/17 as Megatron-LM's:
    every rank stops at the same step, so the shutdown stays orderly)."""
    args.padded_vocab_size = model_vocab_size(args, tokenizer.vocab_size)
    config = transformer_config(args)
    state = pretrain(
        args,
        partial(model_provider, args, config),
        partial(forward_step, args),
        partial(data_iterators, tokenizer=tokenizer),
        config,
        exit_conditions,
    )
    return state.exit_code


def model_vocab_size(args, tokenizer_vocab_size: int) -> int:
    """The embedding's rows: --padded-vocab-size as given (Megatron-LM keeps a given value), else
    the tokenizer's size rounded up to --make-vocab-size-divisible-by x TP. Every rank has the
    same tokenizer, so a too-small value fails alike on all of them."""
    if args.padded_vocab_size is None:
        return padded_vocab_size(
            tokenizer_vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        )
    if args.padded_vocab_size < tokenizer_vocab_size:
        raise ArgumentsError(
            f"--padded-vocab-size ({args.padded_vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer_vocab_size}): its ids would have no embedding row"
        )
    return args.padded_vocab_size


def _classify(err: Exception):
    """(label, exit code) of an error this program reports in one line; code None: a bug."""
    if isinstance(err, CheckpointError):
        return "checkpoint error", 1
    if isinstance(err, ArgumentsError):  # found once the model exists (optimizer factory...)
        return "error", 2
    if isinstance(err, (data_check.DataError, TrainingError)):
        return "error", 1
    return "error", None


def _where() -> str:
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    return (
        f"pretrain_gpt.py: rank {os.environ.get('RANK', '0')}" if ranks > 1 else "pretrain_gpt.py"
    )


def _print_notices(args) -> None:
    """Once, at start-up: derived-value notices and the accepted flags that have no effect."""
    for notice in args.notices:
        _print_error(f"pretrain_gpt.py: note: {notice}")
    if args.no_effect:
        names = " ".join(args.no_effect)
        _print_error(f"pretrain_gpt.py: accepted, no effect in this stack: {names}")


def _print_error(message: str) -> None:
    # Argument errors come before any process group; every rank parses the same command line
    # and fails the same way, so one copy of the message is enough.
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
