"""Config fields an emerging optimizer's constructor no longer takes: refused (patch 0044), not
dropped as upstream's registry does. Why: docs/upstream_repairs.md.
"""

import dataclasses
import inspect


def _unmapped_fields(optimizer_cls: type, prefix: str, config) -> dict:
    """``{field: (value, default)}`` of the ``<prefix>_*`` fields set away from their default
    whose argument ``optimizer_cls.__init__`` does not take."""
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
    """ValueError naming the first ``<prefix>_*`` field set away from its default that the
    installed class takes no argument for.

    Args:
        optimizer_cls: the installed optimizer class the registry builds.
        prefix: the optimizer's name, the fields' prefix (``soap``, ``lion``).
        config: the ``OptimizerConfig``.
    """
    for name, (value, default) in _unmapped_fields(optimizer_cls, prefix, config).items():
        module = optimizer_cls.__module__.split(".")[0]
        raise ValueError(
            f"{name}={value!r} has no effect with optimizer '{prefix}': the installed "
            f"{module} {optimizer_cls.__name__} takes no '{name.removeprefix(prefix + '_')}' "
            f"argument; only the default {default!r} is accepted"
        )
