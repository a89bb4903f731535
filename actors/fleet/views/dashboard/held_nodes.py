"""The nodes the aggregator in this process holds, as the dashboard's history sample
reads them: each one's latest accepted heartbeat, and which of them changed since the last
sample (the table's followers, :meth:`Held.follow`)."""

from __future__ import annotations

from actors.fleet.changed_nodes import BEATS, ChangedNodes
from actors.fleet.live.held import Held
from schemas.messages import Heartbeat


class HeldNodes:
    """The nodes the aggregator in this process holds, each one's latest accepted
    heartbeat, decoded from the bytes it keeps, and which of them changed."""

    def __init__(self, held: Held) -> None:
        self.held = held
        self._changed = ChangedNodes(held.__len__, BEATS)
        """Nodes taken in, let go or beaten since :meth:`changed` was last asked."""
        self._first = True
        held.follow(self._changed.note)

    def changed(self) -> tuple[list[str], bool]:
        """The nodes taken in, let go or beaten since the last call, and whether they are
        every held node instead (the first call, or too many changed to keep)."""
        changed = self._changed.take()
        if changed is None or self._first:
            self._first = False
            return self.nodes(), True
        return list(changed), False

    def __contains__(self, node: object) -> bool:
        return node in self.held

    @property
    def everything(self) -> bool:
        return self.held.everything

    def nodes(self) -> list[str]:
        return [node for node, _ in self.held.items()]

    def heartbeat(self, node: str) -> Heartbeat | None:
        whole = self.held.whole(node)
        return None if whole is None else whole.heartbeat

    def seq(self, node: str) -> int | None:
        """The seq of the node's latest accepted heartbeat, from its record as kept (no
        decode); None if not held."""
        record = self.held.record(node)
        return None if record is None else record.last_seq
