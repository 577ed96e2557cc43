"""Matching a checkpoint's param groups to an optimizer's, by identity and then by order.

Megatron matches groups by an identity tuple (``param_group_identifier_keys``: wd_mult, lr_mult,
is_expert_parallel, is_decoupled_lr; plus ``use_muon`` here). Two groups can share one: the group
``--decoupled-lr`` makes (``get_standard_config_overrides`` sets its ``max_lr`` only, so
``is_decoupled_lr`` stays False) has the default group's identity. A map from identity to group
then keeps the last, and after a resume the default group runs with the decoupled group's lr
bounds. Groups are built in one deterministic order, so among groups of one identity the k-th
saved is the k-th now.
"""

from collections.abc import Callable, Hashable, Sequence


def match_groups(current: Sequence[dict], saved: Sequence[dict], identity: Callable) -> list:
    """The saved group each current group loads from: the next saved group of its identity.

    Args:
        current: the optimizer's param groups, in order.
        saved: the checkpoint's param groups, in the order they were saved.
        identity: a group -> its identity tuple.

    Returns:
        One saved group per current group.

    Raises:
        ValueError: a current group has no saved group of its identity left.
    """
    by_identity: dict[Hashable, list[dict]] = {}
    for group in saved:
        by_identity.setdefault(identity(group), []).append(group)
    out = []
    for group in current:
        key = identity(group)
        left = by_identity.get(key, [])
        if not left:
            raise ValueError(
                f"param group with identity {key} is not in the checkpoint (or it has fewer "
                f"groups of that identity); it has {sorted(map(str, by_identity))}"
            )
        out.append(left.pop(0))
    return out
