"""Config fields an emerging optimizer's constructor no longer takes: refused, not dropped.

Upstream's ``emerging_optimizers.py`` builds a registry optimizer (``--optimizer soap``,
``lion``, ...) from the ``OptimizerConfig`` fields named ``<optimizer>_<argument>`` that the
installed class's ``__init__`` accepts, and drops the others without a word. megatron-core 0.19.2
was written against emerging-optimizers 0.2.0; the pinned 0.3.0's ``SOAP`` has no
``precondition_frequency`` (its eigenbases are updated every step, what upstream's default 1
meant), and ``Lion`` never took ``lion_beta1``/``lion_beta2`` (those reach Lion only as
``--muon-scalar-optimizer lion``; ``--optimizer lion`` uses ``--adam-beta1/2``). Patch
``0040-emerging-optimizers-0.3.0-api.patch`` calls :func:`refuse_unmapped` so a value that would
be dropped is an error naming it; a field left at its default changes nothing.
"""

import dataclasses
import inspect


def unmapped_fields(optimizer_cls: type, prefix: str, config) -> dict:
    """``{field: (value, default)}`` of the config's ``<prefix>_*`` fields set away from their
    default whose argument ``optimizer_cls.__init__`` does not take.

    Args:
        optimizer_cls: the installed optimizer class the registry builds.
        prefix: the optimizer's name, the fields' prefix (``soap``, ``lion``).
        config: the ``OptimizerConfig`` (a dataclass; anything else has no defaults to read).

    Returns:
        ``{field: (value, default)}`` of the fields that would be dropped.
    """
    if not dataclasses.is_dataclass(config):
        return {}  # a stand-in config (tests): no defaults to compare with
    accepted = set(inspect.signature(optimizer_cls.__init__).parameters)
    found = {}
    for f in dataclasses.fields(config):
        argument = f.name.removeprefix(f"{prefix}_")
        if argument == f.name or argument in accepted or f.default is dataclasses.MISSING:
            continue
        value = getattr(config, f.name)
        if value != f.default:
            found[f.name] = (value, f.default)
    return found


def refuse_unmapped(optimizer_cls: type, prefix: str, config) -> None:
    """Raise ``ValueError`` naming the first field :func:`unmapped_fields` finds.

    Args:
        optimizer_cls: the installed optimizer class the registry builds.
        prefix: the optimizer's name, the fields' prefix.
        config: the ``OptimizerConfig``.
    """
    for name, (value, default) in unmapped_fields(optimizer_cls, prefix, config).items():
        module = optimizer_cls.__module__.split(".")[0]
        raise ValueError(
            f"{name}={value!r} has no effect with optimizer '{prefix}': the installed "
            f"{module} {optimizer_cls.__name__} takes no '{name.removeprefix(prefix + '_')}' "
            f"argument; only the default {default!r} is accepted"
        )
