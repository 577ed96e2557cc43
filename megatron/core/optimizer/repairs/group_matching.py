"""Matching a checkpoint's param groups to an optimizer's, by identity and then by order (two
groups can share an identity: docs/checkpoints.md, "repairs/group_matching.py").
"""

from collections.abc import Callable, Hashable, Sequence


def match_groups(current: Sequence[dict], saved: Sequence[dict], identity: Callable) -> list:
    """The saved group each current group loads from: the next saved one of its identity;
    ValueError where none is left.

    Args:
        current: the optimizer's param groups, in order.
        saved: the checkpoint's param groups, in saved order.
        identity: a group -> its identity tuple.

    Returns:
        One saved group per current group.
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
