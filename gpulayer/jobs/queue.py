"""A peer's queue in start order (docs/jobs.md, "The queue"): the highest priority first; within a
priority the submitters in turn (round robin: the one served last goes to the back), and each
submitter's own work first come first served.

The scheduler tries the queued work in this order and starts the first that fits its free slots, so
a priority is honoured as far as the slots allow, and no submitter's many jobs hold back another's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the queue reads of an item: its priority (higher first) and whose share it counts in."""

    priority: int
    share: str  # the submitter, as "user@host" for a job


Item = TypeVar("Item", bound=Queued)


class FairQueue(Generic[Item]):
    """The waiting items: `append`, `remove` (the item started or left), and iteration in start order."""

    def __init__(self) -> None:
        # priority -> submitter -> its items, oldest first; a dict keeps the submitters' turn order
        self._levels: dict[int, dict[str, deque[Item]]] = {}
        self._count = 0

    def append(self, item: Item) -> None:
        self._levels.setdefault(item.priority, {}).setdefault(item.share, deque()).append(item)
        self._count += 1

    def remove(self, item: Item) -> None:
        """Take `item` out (ValueError if it is not queued); its submitter's turn goes to the back."""
        level = self._levels.get(item.priority, {})
        if item not in level.get(item.share, ()):
            raise ValueError("the item is not queued")
        mine = level.pop(item.share)
        mine.remove(item)
        if mine:
            level[item.share] = mine
        if not level:
            del self._levels[item.priority]
        self._count -= 1

    def __contains__(self, item: object) -> bool:
        level = self._levels.get(getattr(item, "priority", None), {})  # type: ignore[arg-type]
        return item in level.get(getattr(item, "share", ""), ())

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Item]:
        """Lazily, in start order: by priority, then one item of each submitter in turn."""
        for priority in sorted(self._levels, reverse=True):
            turns = [iter(items) for items in self._levels[priority].values()]
            while turns:
                for turn in list(turns):
                    item = next(turn, None)
                    if item is None:
                        turns.remove(turn)
                    else:
                        yield item
