"""What ``make pr`` sends upstream: the commits of the series, in review order.

Each commit is (subject, body, our files, our patches): the files are this repository's (paths as
in Megatron-LM), the patches ``patches/``'s. Every file ``tools/fork.py`` links into the tree and
every patch is in one commit (tests/meta/test_make_pr.py checks it). megatron-core 0.19.2 ships
upstream's ``megatron/training``, so the series carries our patches to it and the files of ours
linked into it (the CPU mode, ``gpt_entry``, our Muon's flags).
"""

OPT = "megatron/core/optimizer/"
TRAIN = "megatron/training/"

SERIES = [
    (
        "distrib_optimizer: the DistOpt shard layout in one module",
        "repairs/distopt_layout.py: where DDP's buckets and DistOpt's shards put each model\n"
        "param, "
        "and "
        "the model-space names checkpoints use; read by the Adam checkpoint repairs, the Muon\n"
        "DistOpt exchange and the declared-state checkpoints alike.",
        [OPT + "repairs/__init__.py", OPT + "repairs/distopt_layout.py"],
        [],
    ),
    (
        "distrib_optimizer: torch Adam DistOpt checkpoints resume (upstream's format)",
        "Without TE/Apex a DistOpt checkpoint of torch's Adam/AdamW does not resume in 0.19.2:\n"
        "a fresh optimizer's state_dict asserts (no 'step' yet), loading copies the per-param\n"
        "step and writes params outside no_grad, all params share one step tensor after\n"
        "load_state_dict, and fully_reshardable saves shifted state with several buckets\n"
        "(fixed on main by NVIDIA/Megatron-LM#5077, not in 0.19). The format is unchanged.",
        [
            OPT + "repairs/distopt_adam_checkpoint.py",
            "tests/unit_tests/dist_checkpointing/test_distopt_torch_adam_resume.py",
        ],
        ["0009-distopt-torch-adam-checkpoint-repairs.patch"],
    ),
    (
        "optimizer: Muon config vocabularies and defaults in one module",
        "megatron_muon/config.py holds the Muon vocabularies, the defaults of OptimizerConfig's\n"
        "muon_* "
        "fields (upstream's names and defaults kept; muon_impl and our fields, off by default)\n"
        "and their validation, run where Muon is built.",
        [OPT + "megatron_muon/__init__.py", OPT + "megatron_muon/config.py"],
        ["0001-optimizer-config-muon.patch"],
    ),
    (
        "optimizer: Muon without emerging_optimizers (Newton-Schulz, functional step, Muon)",
        "Pure Newton-Schulz (simple, quintic, polar_express coefficients), the three stages of a\n"
        "Muon step with one Q/K/V split and one scale rule, and a plain torch optimizer holding\n"
        "Muon and AdamW param groups.",
        [
            OPT + "megatron_muon/newton_schulz.py",
            OPT + "megatron_muon/functional.py",
            OPT + "megatron_muon/optimizer.py",
        ],
        [],
    ),
    (
        "optimizer: muon_impl='megatron_muon', our Muon in get_megatron_optimizer",
        "TP orthogonalizers (blockwise, duplicated, distributed), the DistOpt exchange and the\n"
        "factory hooks. muon_impl='megatron_muon' routes --optimizer muon to the standard path\n"
        "(DistributedOptimizer included); the default muon_impl='emerging' keeps upstream's\n"
        "emerging_optimizers Muon and LayerWise optimizer unchanged. muon.py keeps upstream's\n"
        "public names. With use_distributed_optimizer the factory builds\n"
        "MuonDistributedOptimizer, a DistributedOptimizer that plans one owner per matrix\n"
        "(ZeRO-1 Muon, exact) and saves its inner optimizer's declared state in every DistOpt\n"
        "checkpoint format (torch, torch_dist fully/dp-reshardable); a plain\n"
        "DistributedOptimizer refuses such a checkpoint by name; use_muon joins\n"
        "param_group_identifier_keys.",
        [
            OPT + "megatron_muon/tp.py",
            OPT + "megatron_muon/planner/__init__.py",
            OPT + "megatron_muon/planner/cost_model.py",
            OPT + "megatron_muon/planner/placement.py",
            OPT + "megatron_muon/planner/plan.py",
            OPT + "megatron_muon/planner/figures.py",
            OPT + "megatron_muon/planner/gangs.py",
            OPT + "megatron_muon/exchange.py",
            OPT + "repairs/group_matching.py",
            OPT + "megatron_muon/checkpoint.py",
            OPT + "megatron_muon/checkpoint_sharded.py",
            OPT + "megatron_muon/distrib_optimizer.py",
            OPT + "megatron_muon/factory.py",
            OPT + "muon.py",
            "tests/unit_tests/optimizer/test_megatron_muon_distributed_optimizer.py",
        ],
        [
            "0002-optimizer-factory-muon.patch",
            "0011-distopt-declared-state-checkpoint.patch",
            "0012-param-group-identity-use-muon.patch",
        ],
    ),
    (
        "distrib_optimizer: param groups of one identity are matched in order on load",
        "A map from a group's identity (param_group_identifier_keys) to the saved group keeps\n"
        "the last of two groups of one identity. The k-th saved group of an identity now loads\n"
        "into the k-th current one (group_matching.match_groups). Upstream's own groups never\n"
        "share an identity (the keys hold every key that forms a group, is_decoupled_lr too), so\n"
        "this is no upstream fix: it travels with our Muon, whose checkpoints share the module.",
        [],
        ["0016-distopt-param-groups-matched-in-order.patch"],
    ),
    (
        "transformer: QK-clip (MuonClip) without Transformer Engine",
        "Local attention records per-head max attention logits; clip_qk scales query/key rows\n"
        "after the optimizer step, on model params, fp32 main params and DistOpt shards, by\n"
        "upstream's per-group rule (qk_clip_per_head, off by default: one eta per query head).",
        [
            OPT + "qk_clip.py",
            "megatron/core/transformer/max_attention_logit.py",
            "megatron/core/transformer/qk_clip_config.py",
            "tests/unit_tests/transformer/test_local_attention_qk_clip.py",
        ],
        ["0013-transformer-config-qk-clip-checks.patch", "0014-local-attention-max-logit.patch"],
    ),
    (
        "transformer: zero-centered gamma (apply-layernorm-1p) for the local torch norms",
        "WrappedTorchNorm asserted layernorm_zero_centered_gamma off; it now returns LayerNorm /\n"
        "RMSNorm modules whose weight is gamma (scale 1 + gamma, gamma initialized to 0), as TE\n"
        "and Apex store it (zero_centered_norm.local_norm_class, which also gives the SP-marked\n"
        "class that the next commit admits).",
        ["megatron/core/transformer/zero_centered_norm.py"],
        ["0015-local-norm-zero-centered-gamma.patch"],
    ),
    (
        "transformer: sequence parallelism with the local torch norms",
        "WrappedTorchNorm asserted sequence_parallel off, so MoE at TP > 1 (which requires it)\n"
        "could not run without Transformer Engine or Apex. With sequence_parallel its norms'\n"
        "params are marked sequence_parallel as TE's and Apex's are, and finalize_model_grads\n"
        "all-reduces their grads over TP; without it nothing changes.",
        ["tests/unit_tests/transformer/test_local_norm_sequence_parallel.py"],
        ["0017-torch-norm-sequence-parallel.patch"],
    ),
    (
        "transformer: multi-latent attention with the local core attention",
        "MLASelfAttention builds its core attention with k_channels (query/key head dim) and\n"
        "v_channels (value head dim); the local DotProductAttention took neither, so MLA needed\n"
        "Transformer Engine. It now sizes its output by v_channels and its default softmax\n"
        "scale by k_channels; without them, kv_channels as before.",
        ["tests/unit_tests/transformer/test_local_attention_mla.py"],
        ["0018-local-attention-mla-head-dims.patch"],
    ),
    (
        "transformer: MLA's shared rope key grad summed over TP (column-parallel kv_down_proj)",
        "With a column-parallel linear_kv_down_proj (the local spec's) MLA gathers its output\n"
        "over TP, whose backward keeps each rank's slice of the grad. The latent part's grad is\n"
        "whole (linear_kv_up_proj sums it over TP), but the shared rope key k_pos_emb is used\n"
        "by each rank's own heads only, so its grad was one rank's heads' part: kv_down_proj and\n"
        "the hidden-state grads missed at TP > 1, with and without SP (Megatron-LM issue 1699).\n"
        "k_pos_emb now passes copy_to_tensor_model_parallel_region (backward: all-reduce). The\n"
        "duplicated linear (TE's default spec) takes the other branch, unchanged.",
        ["tests/unit_tests/transformer/test_mla_rope_key_grad_tp.py"],
        ["0019-mla-rope-key-grad-over-tp.patch"],
    ),
    (
        "distributed: MLA's q_layernorm grad not summed over TP twice",
        "With qk_layernorm, finalize_model_grads sums over TP the grads of params named\n"
        "q_layernorm / k_layernorm: per-head norms, each rank holding its heads' part. MLA's\n"
        "q_layernorm normalizes the whole q latent; without SP its grad is already whole on\n"
        "every rank and was multiplied by TP (with SP it is sequence-sharded and marked\n"
        "sequence_parallel, summed by that rule). The name rule now skips MLA configs.",
        ["tests/unit_tests/transformer/test_mla_q_layernorm_grad_tp.py"],
        ["0020-mla-q-layernorm-grad-once.patch"],
    ),
    (
        "optimizer: one loss scale for the dense and the expert optimizer (fp16 with EP)",
        "With expert parallelism the dense and the expert optimizer each have a grad scaler and\n"
        "each updated it with its own inf/NaN check; the loss is scaled by the first one's.\n"
        "An inf only in expert grads backed off the expert scaler alone, and later expert grads\n"
        "were unscaled by the wrong factor. ChainedOptimizer.prepare_grads now updates every\n"
        "scaler with the chain's verdict (repairs/chained_grad_scaler.py).",
        [
            OPT + "repairs/chained_grad_scaler.py",
            "tests/unit_tests/optimizer/test_chained_optimizer_loss_scale.py",
        ],
        ["0021-chained-optimizer-one-loss-scale.patch"],
    ),
    (
        "moe: an expert's weighted bias is added out of place",
        "Experts with biases outside expert parallelism crashed at the first forward: at TP=1\n"
        "the row-parallel reduce returns its input as is, and MLP.forward added the routing-\n"
        "weighted bias to that view in place, which autograd forbids.",
        ["tests/unit_tests/transformer/moe/test_expert_bias.py"],
        ["0022-moe-expert-bias-out-of-place.patch"],
    ),
    (
        "moe: paged stash imports without triton",
        "import megatron.core reaches moe/ops/paged_stash.py (distributed -> finalize_model_grads\n"
        "-> pipeline_parallel.schedules -> moe.paged_stash), which imported triton unguarded: a\n"
        "CPU torch has none. Guarded as other upstream modules guard it (as PR #6891 does).",
        [],
        ["0024-moe-paged-stash-triton-optional.patch"],
    ),
    (
        "dist_checkpointing: the async writer's queue survives a SIGTERM to the job",
        "The torch_dist writer's results queue lives in a multiprocessing Manager that the first\n"
        "save starts inside the rank's process group; torchrun (and Slurm) forward SIGTERM to\n"
        "that group, so --exit-signal-handler's save found the Manager dead (BrokenPipeError):\n"
        "nothing saved, every rank exit 1. The Manager now ignores SIGTERM/SIGINT; its owner\n"
        "still shuts it down at exit.",
        ["tests/unit_tests/dist_checkpointing/test_write_results_queue_signals.py"],
        ["0032-checkpoint-writer-queue-survives-sigterm.patch"],
    ),
    (
        "dist_checkpointing: the persistent async checkpoint worker runs without CUDA",
        "--async-save --use-persistent-ckpt-worker (upstream's MoE Muon recipes) hands each\n"
        "save to a worker process started fresh (forkserver), which called\n"
        "torch.cuda.set_device(rank % device_count()) (ZeroDivisionError without CUDA) and,\n"
        "preloading, torch.cuda.synchronize() (no driver): the worker died and every rank\n"
        "waited on it for ever. Both are skipped where CUDA is unavailable; GPUs as before.",
        ["tests/unit_tests/dist_checkpointing/test_async_worker_without_cuda.py"],
        ["0033-async-checkpoint-worker-without-cuda.patch"],
    ),
    (
        "emerging_optimizers: TensorParallelAdaptiveMuon on emerging-optimizers 0.3.0",
        "0.19 was written against emerging-optimizers 0.2.0; the package index has 0.3.0, whose\n"
        "AdaptiveMuon.step reads scale_mode and extra_scale_factor, which 0.19.2's\n"
        "TensorParallelAdaptiveMuon never set (AttributeError at the first step). It sets them,\n"
        "as upstream main does since it moved to 0.3.0 (2c8ac9b753).",
        ["tests/unit_tests/optimizer/test_adaptive_muon_emerging_0_3.py"],
        ["0040-emerging-optimizers-0.3.0-api.patch"],
    ),
    (
        "emerging_optimizers: a config field the optimizer would drop is refused, naming it",
        "An emerging optimizer is built from the OptimizerConfig fields named\n"
        "<optimizer>_<argument> that the installed class takes; the others were dropped without\n"
        "a word (lion_beta1/2 with Lion as --optimizer, which takes --adam-beta1/2; SOAP's\n"
        "precondition_frequency on emerging-optimizers 0.3.0). A field set away from its default\n"
        "that the class takes no argument for now raises ValueError naming it.",
        [
            OPT + "repairs/emerging_fields.py",
            "tests/unit_tests/optimizer/test_emerging_optimizer_field_refused.py",
        ],
        ["0044-emerging-optimizer-fields-refused.patch"],
    ),
    (
        "layer_wise_optimizer: the uneven all-gather on gloo",
        "The legacy LayerWise path all-gathers tensors of different sizes per rank, after the\n"
        "step and in the DDP buckets' param sync (--overlap-param-gather included), which NCCL\n"
        "allows and gloo refuses: on gloo each part is padded to the largest and sliced back\n"
        "(repairs/uneven_all_gather.py), and a bucket group's wait waits for each padded gather;\n"
        "NCCL "
        "calls torch's all_gather and waits for the last as before.",
        [OPT + "repairs/uneven_all_gather.py"],
        ["0041-layer-wise-all-gather-on-gloo.patch"],
    ),
    (
        "optimizer: torch Adam's per-param step kept in seeded and saved states",
        "Without TE/Apex the states seeded for loading got no 'step', and 'if step:' dropped a\n"
        "step of 0 when saving: loading raised KeyError: 'step'. init_state_fn seeds it\n"
        "(repairs/torch_adam_step.py, torch's Adam only) and a step of 0 is saved.",
        [
            OPT + "repairs/torch_adam_step.py",
            "tests/unit_tests/optimizer/test_torch_adam_step_on_load.py",
        ],
        ["0042-torch-adam-step-kept.patch"],
    ),
    (
        "optimizer: a Float16 optimizer's empty param group survives a torch_dist resume",
        "dist_checkpointing keeps an empty list in the common state but drops the places of\n"
        "fully sharded lists, so fp32_from_fp16_params with an empty group (megatron_muon's\n"
        "Muon/AdamW halves: no Muon biases or norms) raised 'Cannot merge two lists with\n"
        "different lengths' at load (bf16 without --use-distributed-optimizer). Keyed by group\n"
        "index, as LayerWise already keys its own (which now takes either form); the sharded\n"
        "tensors and their keys are unchanged.",
        ["tests/unit_tests/optimizer/test_float16_empty_group_torch_dist.py"],
        ["0043-float16-optimizer-empty-groups-torch-dist.patch"],
    ),
    (
        "argument_utils: a '%' in a config docstring no longer breaks --help",
        "ArgumentGroupFactory hands each field's docstring to argparse as its help, and argparse\n"
        "formats help with %: TransformerConfig.moe_paged_stash_buffer_size_factor_cuda's\n"
        "docstring says 10%, so every --help raised ValueError. Docstring help escapes its %.",
        ["tests/unit_tests/test_argument_help_percent.py"],
        ["0050-training-help-percent-in-docstrings.patch"],
    ),
    (
        "training: --muon-impl and our Muon's flags on upstream's command line",
        "muon_args.py registers --muon-impl {emerging,megatron_muon} (default emerging:\n"
        "upstream's meaning) and our knobs, defaults read from OptimizerConfig, validated in\n"
        "validate_args; --muon-impl megatron_muon with --use-distributed-optimizer is not\n"
        "rewritten to the LayerWise optimizer.",
        [TRAIN + "muon_args.py"],
        ["0030-training-args-megatron-muon.patch"],
    ),
    (
        "checkpointing: refuse a checkpoint of the other Muon, naming --muon-impl",
        "The two Muons' optimizer states differ in layout and keys: check_checkpoint_args (and\n"
        "torch_dist's load, before the optimizer state is built) refuses one loaded by the other\n"
        "in one line naming the flag; --no-load-optim loads the model only.",
        [],
        ["0031-checkpoint-args-muon-impl.patch"],
    ),
    (
        "training: pretrain_gpt's GPT entry on pretrain(), and CPU ranks for it",
        "gpt_entry.py: the model and datasets providers and the forward step for pretrain();\n"
        "cpu_mode.py and cpu_loop.py: stand-ins for megatron-core and the loop where CUDA is\n"
        "absent (gloo CPU ranks), installed by nothing on GPUs.",
        [
            TRAIN + "cpu_mode.py",
            TRAIN + "cpu_loop.py",
            TRAIN + "gpt_entry.py",
            TRAIN + "muon_recipe.py",
        ],
        [],
    ),
    (
        "training: --qk-clip with local attention, and the optimizer passed to clip_qk",
        "Local core attention records the max attention logits (patch 0014), so --qk-clip and\n"
        "--log-max-attention-logit are allowed with --transformer-impl local (the TE >= 2.9\n"
        "check stays for TE); train_step passes the optimizer to clip_qk, which bf16 with the\n"
        "DistributedOptimizer needs to clip its fp32 main shards.",
        [],
        [
            "0060-training-args-qk-clip-local-attention.patch",
            "0061-training-clip-qk-optimizer.patch",
        ],
    ),
    (
        "training: --full-validation with one validation set no longer raises",
        "evaluate_and_print_results built the tensor of eval iterations it broadcasts from\n"
        "args.eval_iters, an int with one validation set: a 0-d tensor whose tolist() is an int,\n"
        "so eval_iters[0] raised TypeError at the first evaluation. The list it made is used.",
        ["tests/unit_tests/training/test_full_validation_one_set.py"],
        ["0062-training-full-validation-one-set.patch"],
    ),
    (
        "distrib_optimizer: Muon matrices shard-aligned where that balances (no exchange)",
        "MuonDistributedOptimizer.compute_full_param_layout gives DDP upstream's LayerWise layout\n"
        "for the Muon matrices (each whole in one DP shard) where the holders' Newton-Schulz\n"
        "loads balance within 5% of the mean; the planner then lets each holder own its\n"
        "matrices and the exchange moves nothing. Elsewhere DistOpt's layout and the exchange.\n"
        "get_model asks our Muon's class for the layout (wrap_model_chunks_with_ddp's new\n"
        "distributed_optimizer_class, upstream's DistributedOptimizer by default).",
        [OPT + "megatron_muon/layout.py"],
        ["0063-training-ddp-layout-megatron-muon.patch"],
    ),
    (
        "tokenizers: GPT-2 BPE and BERT WordPiece from local files, without the hub",
        "MegatronHFTokenizer asked the hub (AutoTokenizer.from_pretrained('gpt2', vocab_file=...,\n"
        "merges_file=...)) for what the files and the hub's tokenizer config give: offline it\n"
        "failed or retried, online the hub's tokenizer.json won over the files given. The\n"
        "tokenizer is built from --vocab-file/--merge-file (tokenizers' own readers) and the\n"
        "hub's config; without files and wget every rank raises one line naming the flags.",
        ["tests/unit_tests/tokenizers/test_gpt2_bpe_local_files.py"],
        ["0070-tokenizers-gpt2-bpe-local-files.patch"],
    ),
    (
        "tokenizers: transformers imported on first use, not by every run",
        "The text tokenizers package imported transformers at module level in three modules, so\n"
        "every process paid the import (2.4 s of a CPU rank's 21 s of startup), NullTokenizer\n"
        "runs included. The import moves to where a tokenizer first needs it; HAVE_TRANSFORMERS\n"
        "asks importlib whether it is installed.",
        [],
        ["0071-tokenizers-transformers-imported-on-use.patch"],
    ),
    (
        "training: preprocess_data from the package; one-line preflight of files and packages",
        "python -m megatron.training.preprocess_data: jsonl to .bin/.idx with the flags of\n"
        "tools/preprocess_data.py (which the package does not ship), the tokenizer built once\n"
        "before the workers fork. preflight.py names, in one line before any rank or worker\n"
        "starts, a missing tokenizer file, flag or package (and einops for Megatron-FSDP).",
        [
            TRAIN + "preflight.py",
            TRAIN + "preprocess_data.py",
            "tests/unit_tests/data/test_preprocess_data_package.py",
        ],
        [],
    ),
    (
        "checkpointing: Megatron-FSDP and FSDP2 checkpoints save and resume",
        "fsdp_dtensor: a rank holding none of a parameter (Megatron-FSDP shards buckets by\n"
        "bytes) has no optimizer state for it, and the per-DTensor collectives of\n"
        "preprocess_state_dict_for_uneven_dtensor hung; it takes a holder's entry (empty shards,\n"
        "the holder's step). torch_dcp: the load asked state_dict(is_loading=True) of a\n"
        "ChainedOptimizer, which takes no such argument, and offered DCP no key for torch SGD's\n"
        "momentum (made at the first step; now a zero buffer). fsdp_dtensor resumes restore\n"
        "num_floating_point_operations_so_far.",
        [
            TRAIN + "fsdp_checkpoint.py",
            "tests/unit_tests/dist_checkpointing/test_torch_dcp_chained_optimizer_load.py",
            "tests/unit_tests/dist_checkpointing/test_fsdp_dtensor_resume.py",
        ],
        [
            "0080-fsdp-dtensor-empty-shard-state.patch",
            "0081-torch-dcp-load-optimizer-state.patch",
            "0082-fsdp-dtensor-load-flops-counter.patch",
        ],
    ),
    (
        "optimizer: our Muon under ZeRO-3 (Megatron-FSDP, torch FSDP2)",
        "A ZeRO-3 shard of a matrix is a range of its flattened elements, as under the\n"
        "DistributedOptimizer: megatron_muon/fsdp.py reads Megatron-FSDP's flat buffers and\n"
        "FSDP2's Shard(0) row blocks as such ranges, so the DistOpt plan and exchange\n"
        "orthogonalize each matrix whole once per step on a balanced owner. Megatron-FSDP's\n"
        "argument check admits --muon-impl megatron_muon; upstream's Muon keeps its refusal.",
        [
            OPT + "megatron_muon/fsdp.py",
            "tests/unit_tests/optimizer/test_megatron_muon_zero3.py",
        ],
        ["0090-training-megatron-fsdp-admits-megatron-muon.patch"],
    ),
    (
        "training: --muon-tp-mode owner, our exact TP mode without duplicated NS",
        "megatron_muon/tp.py's 'owner' mode orthogonalizes each TP-sharded matrix whole on one\n"
        "rank of TP x DP (two TP all-to-alls per step; without DistOpt one all-gather over DP),\n"
        "so NS runs once per matrix over the grid; upstream's --muon-tp-mode admits the value\n"
        "(muon_args.admit_muon_tp_mode_owner), which needs --muon-impl megatron_muon.",
        ["tests/unit_tests/optimizer/test_megatron_muon_tp_owner.py"],
        ["0091-training-args-muon-tp-mode-owner.patch"],
    ),
    (
        "checkpointing: our Muon's DistOpt and ZeRO-3 checkpoints refused across",
        "A DistOpt (torch_dist) checkpoint of our Muon under Megatron-FSDP or FSDP2, or the\n"
        "reverse, failed after the load began (KeyError 'model', or an AttributeError inside\n"
        "DCP). For our Muon the checkpoint's args are read first for torch_dcp too\n"
        "(muon_args.check_muon_impl_before_load), and the mismatch is refused in one line\n"
        "naming the flags, on every rank, before any state is loaded.",
        [],
        ["0092-checkpoint-distopt-zero3-refused.patch"],
    ),
    (
        "training: Megatron-FSDP's HSDP sums the replicas without --overlap-grad-reduce",
        "Megatron-FSDP turns overlap_grad_reduce on itself when it shards gradients and, under\n"
        "HSDP, all-reduces across the replicas only on a micro-batch that no_sync marks last;\n"
        "train() hooked no_sync only for --overlap-grad-reduce, so without the flag the replicas\n"
        "never summed their gradients. train() now also hooks no_sync where Megatron-FSDP\n"
        "overlaps on its own.",
        [],
        ["0093-training-megatron-fsdp-hsdp-no-sync.patch"],
    ),
    (
        "dist_checkpointing: an async save copies the host tensors the trainer shares",
        "The persistent async checkpoint worker receives each request through a queue, which\n"
        "moves a host tensor's storage into shared memory; its preload copied GPU tensors only,\n"
        "and the trainer updated the shared ones in place at the next step (the DistOpt's fp32\n"
        "main params and Adam moments): files got the next step's values where the writer was\n"
        "late (CPU training, --optimizer-cpu-offload). A shared host tensor is now copied as a\n"
        "GPU tensor is; a synchronous save's private host memory is not.",
        ["tests/unit_tests/dist_checkpointing/test_async_save_host_tensors.py"],
        ["0094-async-save-copies-shared-host-tensors.patch"],
    ),
]
# Files of ours linked into the tree that the series does not send: the built-in corpora of the
# demo and the benchmarks (this project's, not upstream material)
UNSENT = [TRAIN + "corpus.py", TRAIN + "shakespeare.py"]


def _commit(name: str) -> tuple:
    """The commit of SERIES that carries the patch or file ``name`` (a patch's number will do)."""
    found = [c for c in SERIES if any(x == name or x.startswith(name + "-") for x in c[3] + c[2])]
    assert len(found) == 1, (name, len(found))
    return found[0]


# Megatron-LM's main branch as pinned for the second check of `make pr` (MEGATRON_LM_CHECKOUT):
# the commit of github.com/NVIDIA/Megatron-LM main the series were last checked on.
MAIN_PIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # 2026-08-22, main
MAIN_CHECKOUT_ENV = "MEGATRON_LM_CHECKOUT"
# The pull requests: independent series, each one concern, each applied alone to a pristine tree
# (a commit may sit in several: a feature carries the modules it builds on). (slug, commits,
# main): main is True where the series must apply to MAIN_PIN with `git am`, else why not.
_MUON_BASE = [OPT + "repairs/distopt_layout.py", "0001", OPT + "megatron_muon/optimizer.py"]
PRS = [
    ("fix-torch-adam-step", ["0042"], True),
    (
        "fix-distopt-torch-adam-checkpoint",
        [OPT + "repairs/distopt_layout.py", "0009"],
        "fixed on main by NVIDIA/Megatron-LM#5077 (0.19.2 only)",
    ),
    ("fix-mla-rope-key-grad-over-tp", ["0018", "0019"], True),  # on local-mla
    ("fix-mla-q-layernorm-grad-once", ["0018", "0020"], True),  # on local-mla
    ("fix-chained-optimizer-one-loss-scale", ["0021"], True),
    ("fix-moe-expert-bias-out-of-place", ["0022"], True),
    ("fix-writer-queue-survives-sigterm", ["0032"], True),
    ("fix-async-worker-without-cuda", ["0033"], True),
    (
        "fix-emerging-optimizers-0.3.0",
        ["0040"],
        "main moved to emerging-optimizers 0.3.0 itself (Megatron-LM 2c8ac9b753; 0.19.2 only)",
    ),
    ("fix-emerging-optimizer-fields-refused", ["0044"], True),
    ("fix-layer-wise-all-gather-on-gloo", ["0041"], True),
    ("fix-float16-empty-groups-torch-dist", ["0043"], True),
    ("fix-help-percent", ["0050"], True),
    ("fix-full-validation-one-set", ["0062"], True),
    ("fix-tokenizers-local-files", ["0070"], True),
    ("tokenizers-transformers-on-use", ["0070", "0071"], True),
    ("fix-fsdp-checkpoints", ["0080"], True),
    ("fix-megatron-fsdp-hsdp-no-sync", ["0093"], True),
    ("fix-async-save-host-tensors", ["0094"], True),
    ("local-sequence-parallel-norms", ["0015", "0017"], True),
    ("local-mla", ["0018"], True),
    ("qk-clip-local-attention", ["0013", "0060"], True),
    ("muon-distributed-optimizer", [*_MUON_BASE, "0002", "0016", "0030", "0031", "0063"], True),
    ("muon-tp-owner", [*_MUON_BASE, "0002", "0016", "0030", "0031", "0063", "0091"], True),
    ("muon-zero3", [*_MUON_BASE, "0002", "0016", "0030", "0031", "0063", "0080", "0090"], True),
    (
        "muon-zero3-checkpoints-refused-across",
        [*_MUON_BASE, "0002", "0016", "0030", "0031", "0063", "0080", "0090", "0092"],
        True,
    ),
    ("training-preprocess-preflight", [TRAIN + "preflight.py"], True),
]
PRS = [(slug, [_commit(c) for c in commits], main) for slug, commits, main in PRS]
# Commits of SERIES that no pull request carries: the fork's own (CPU stand-ins and the GPT entry
# our pretrain_gpt.py runs; the triton stand-in, which upstream's PR #6891 replaces)
FORK_ONLY = [_commit(TRAIN + "cpu_mode.py"), _commit("0024")]
# The form a patch takes in the pull requests where it differs from the fork's: the repair
# written in the file it repairs (the fork keeps its repairs/ module), or the hunks placed where
# Megatron-LM main and 0.19.2 read alike (patches/pr/)
PR_FORM = {
    name: f"pr/{name}"
    for name in (
        "0016-distopt-param-groups-matched-in-order.patch",
        "0042-torch-adam-step-kept.patch",
        "0044-emerging-optimizer-fields-refused.patch",
    )
}
# Files of ours that only a patch's fork form calls (its PR form writes the repair in the file it
# repairs): make_pr does not send them
FORK_FORM_ONLY = {OPT + "repairs/torch_adam_step.py", OPT + "repairs/emerging_fields.py"}
# The fork's tests that cover each commit (its patch, else its first file), named in the commit's
# message beside the upstream-form tests (tests/unit_tests/) it carries
FORK_TESTS = {
    "0009": "tests/distributed/test_adam_checkpoint.py",
    "0001": "tests/unit/test_muon_config.py",
    OPT + "megatron_muon/optimizer.py": "tests/unit/test_muon.py",
    "0002": "tests/distributed/test_muon_distopt.py, tests/distributed/test_muon_checkpoint.py",
    "0016": "tests/unit/test_optimizer_state_regressions.py",
    "0013": "tests/unit/test_qk_clip_rule.py, tests/distributed/test_qk_clip.py",
    "0015": "tests/distributed/test_sequence_parallel_norm.py",
    "0017": "tests/distributed/test_sequence_parallel_norm.py",
    "0018": "tests/distributed/test_local_attention_mla.py",
    "0019": "tests/distributed/test_mla_tensor_parallel.py",
    "0020": "tests/distributed/test_mla_tensor_parallel.py",
    "0021": "tests/unit/test_chained_grad_scaler.py",
    "0032": "tests/e2e/test_upstream_signals.py",
    "0033": "tests/unit/test_async_ckpt_worker.py",
    "0040": "tests/e2e/test_upstream_optimizers.py",
    "0044": "tests/e2e/test_upstream_optimizers.py",
    "0041": "tests/distributed/test_uneven_all_gather.py",
    "0042": "tests/e2e/test_upstream_optimizers.py",
    "0043": "tests/distributed/test_muon_checkpoint.py",
    "0050": "tests/e2e/test_help.py",
    "0030": "tests/e2e/test_muon_args.py",
    "0031": "tests/e2e/test_muon_args.py",
    "0060": "tests/unit/test_qk_clip_rule.py, tests/e2e/test_upstream_qk_clip.py",
    "0062": "tests/unit/test_convergence_bench.py",
    "0063": "tests/distributed/test_muon_distopt.py",
    "0070": "tests/unit/test_offline_tokenizers.py",
    "0071": "tests/unit/test_tokenizer_imports.py",
    "0080": "tests/e2e/test_fsdp_loop.py, tests/unit/test_fsdp_checkpoint_sgd.py",
    "0090": "tests/distributed/test_fsdp_muon.py, tests/e2e/test_fsdp_muon_e2e.py",
    "0091": "tests/distributed/test_muon_tp_owner.py, tests/e2e/test_muon_args.py",
    "0092": "tests/e2e/test_muon_args.py, tests/distributed/test_fsdp_checkpoint.py",
    "0093": "tests/distributed/test_fsdp_muon.py (hsdp cases, test_hsdp_before_0093_misses)",
    "0094": "tests/unit/test_async_save_host_tensors.py, tests/e2e/test_offline_recipe.py",
    TRAIN + "preflight.py": "tests/unit/test_offline_preprocess.py",
    OPT + "repairs/distopt_layout.py": "tests/distributed/test_adam_checkpoint.py",
}
FORK_TESTS = {id(_commit(key)): tests for key, tests in FORK_TESTS.items()}
