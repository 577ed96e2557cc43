"""The TransformerConfig ``pretrain_gpt.py`` builds from a command line: upstream's
``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``, the calls its
``pretrain()`` makes (``megatron/training/gpt_entry.py``).
"""

import argparse
import contextlib
import functools
import io
import os
import sys
from unittest import mock


def transformer_config(argv: list, world_size: int):
    """The model config of ``pretrain_gpt.py argv`` launched on ``world_size`` ranks."""
    from megatron.training import arguments

    launch = {"WORLD_SIZE": str(world_size), "RANK": "0"}  # what torchrun tells each rank
    with (
        mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv]),
        mock.patch.dict(os.environ, launch),
        contextlib.redirect_stdout(io.StringIO()),  # validate_args prints every argument
    ):
        args = arguments.parse_args()
        arguments.validate_args(args, {})
    return arguments.core_transformer_config_from_args(args)


@functools.cache
def known_flags() -> frozenset:
    """Every option string of ``pretrain_gpt.py``'s parser (upstream's ``add_megatron_arguments``
    with the flags our patches add)."""
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    return frozenset(parser._option_string_actions)
