# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""--help of Megatron-LM's parser: argparse formats each help text with %, and a config field's
docstring is handed to it as help (ArgumentGroupFactory), so a literal '%' in one
(TransformerConfig.moe_paged_stash_buffer_size_factor_cuda: "10%") raised ValueError."""

import argparse

from megatron.training.arguments import add_megatron_arguments


def test_help_formats_a_percent_sign_in_a_docstring():
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    # before the fix: ValueError: unsupported format character ')' (0x29)
    text = " ".join(parser.format_help().split())
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text
    assert "(e.g. 1.10 = 10%)" in text
