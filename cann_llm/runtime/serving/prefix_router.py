"""Where the Ray ingress sends a request, as Ray Serve request routers (its public `RequestRouter` API).

`PrefixAffinityRouter` places a request on the replica whose prefix cache most likely holds the start of
its prompt, as SGLang's router and vLLM's production stack do: each replica's past prompts are kept as
chains of hashed 64-character blocks (the hash of a block covers every block before it, so a match is
always a prefix), and a request goes to the replica matching the most of its blocks, if that is at least
`match_rate_threshold` of its prompt and the replicas' loads are within `imbalanced_threshold` requests
of each other; otherwise to the least loaded replica (ties: the one holding the least cached text). A
server-kept conversation stays on the replica that holds it, however loaded. A request with no prompt
(`/v1/models`) is placed by load alone.

Ray's own prefix-cache router (in its LLM package) was measured first: it keeps the tree in a separate
actor, blocking the ingress's event loop on two or three actor calls per request, and it records a
request only once it has been sent, so chats arriving together all saw the same "smallest" replica:
8 concurrent chats ended with all 32 turns on one of two replicas and twice the TTFT of random
placement (docs/scale-out.md). Here the choice is counted as soon as it is made (and credited to the replica
once sent), and the state lives in the router itself (one ingress replica holds it).

`RoundRobinRouter` is the baseline it is measured against; `--router pow2` is Ray Serve's default."""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_CHARS = 64
_MAX_BLOCKS = 200_000  # per replica, least recently used forgotten first (~ a 12 MB prompt history)
_PLACING_S = 10.0      # a choice not followed by a send within this long was abandoned (the caller left)
_MAX_CONVERSATIONS = 100_000


def block_chain(text: str) -> list[bytes]:
    """Hashes of `text`'s whole 64-character blocks, each covering the blocks before it."""
    chain, digest = [], b""
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        digest = hashlib.blake2b(digest + text[start:start + BLOCK_CHARS].encode(), digest_size=12).digest()
        chain.append(digest)
    return chain


class PrefixAffinityRouter(RequestRouter):
    """Requests to the replica caching their prompt's prefix, else to the least loaded."""

    def initialize_state(self, imbalanced_threshold: int = 8, match_rate_threshold: float = 0.1, **_):
        self._imbalanced_threshold, self._match_rate_threshold = imbalanced_threshold, match_rate_threshold
        self._blocks: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        self._running: Counter[ReplicaID] = Counter()      # sent and not completed
        self._placed: dict[str, _Placement] = {}          # chosen, not yet sent: by internal request id
        self._requests: dict[str, ReplicaID] = {}         # sent: by internal request id
        self._ended_early: dict[str, float] = {}          # completed before their send was reported
        self._conversations: OrderedDict[str, ReplicaID] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        call = pending_request.args[0] if pending_request is not None and pending_request.args else None
        conversation = getattr(call, "conversation_id", None)
        text = getattr(call, "routing_text", "") or ""
        now = time.monotonic()
        self._placed = {r: p for r, p in self._placed.items() if now - p.at < _PLACING_S}
        load = {r.replica_id: self._running[r.replica_id] for r in candidate_replicas}
        for placement in self._placed.values():  # chosen for requests still being sent: they count already
            if placement.replica in load:
                load[placement.replica] += 1
        chain = block_chain(text)
        chosen = next((r for r in candidate_replicas if r.replica_id == self._conversations.get(conversation)), None)
        if chosen is None and chain and max(load.values()) - min(load.values()) <= self._imbalanced_threshold:
            matched = {r.replica_id: self._matched(r.replica_id, chain) for r in candidate_replicas}
            best = max(matched.values())
            if best and best * BLOCK_CHARS >= self._match_rate_threshold * len(text):
                chosen = min((r for r in candidate_replicas if matched[r.replica_id] == best),
                             key=lambda r: load[r.replica_id])
        if chosen is None:
            chosen = min(candidate_replicas, key=lambda r: (load[r.replica_id], len(self._blocks.get(r.replica_id, ()))))
        if pending_request is not None:  # a retry of the choice replaces it
            self._placed[pending_request.metadata.internal_request_id] = _Placement(chosen.replica_id, now, chain,
                                                                                    conversation)
        return [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = pending_request.metadata.internal_request_id
        placement = self._placed.pop(request, None)
        if placement is not None:  # credited to the replica that took it, whichever was chosen
            self._remember(replica_id, placement.chain)
            if placement.conversation:
                self._conversations[placement.conversation] = replica_id
                self._conversations.move_to_end(placement.conversation)
                while len(self._conversations) > _MAX_CONVERSATIONS:
                    self._conversations.popitem(last=False)
        if self._ended_early.pop(request, None) is None:
            self._requests[request] = replica_id
            self._running[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent_to = self._requests.pop(internal_request_id, None)
        if sent_to is None:  # Ray may report the end before the send: the send is then not counted
            now = time.monotonic()
            self._ended_early = {r: at for r, at in self._ended_early.items() if now - at < _PLACING_S}
            self._ended_early[internal_request_id] = now
        elif self._running.get(sent_to, 0) > 0:
            self._running[sent_to] -= 1

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # a replica scaled down or replaced takes its cache and conversations with it
        current = set(self.curr_replicas)
        for table in (self._blocks, self._running):
            for gone in [r for r in table if r not in current]:
                del table[gone]
        self._conversations = OrderedDict((c, r) for c, r in self._conversations.items() if r in current)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # its cache and its conversations died with it: their next turns start afresh wherever they land
        self._blocks.pop(replica_id, None)
        self._running.pop(replica_id, None)
        self._conversations = OrderedDict((c, r) for c, r in self._conversations.items() if r != replica_id)
        super().on_replica_actor_died(replica_id)

    def _matched(self, replica: ReplicaID, chain: list[bytes]) -> int:
        """How many leading blocks of `chain` the replica holds or is about to be sent."""
        blocks = self._blocks.get(replica) or {}
        pending = [p.chain for p in self._placed.values() if p.replica == replica]
        count = 0
        for index, digest in enumerate(chain):
            if digest not in blocks and not any(len(c) > index and c[index] == digest for c in pending):
                break
            count += 1
        return count

    def _remember(self, replica: ReplicaID, chain: list[bytes]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for digest in chain:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > _MAX_BLOCKS:
            blocks.popitem(last=False)


@dataclass
class _Placement:
    """A choice not yet sent: the replica, when, the prompt's blocks, its conversation."""

    replica: ReplicaID
    at: float
    chain: list[bytes]
    conversation: str | None


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn, whatever it holds or runs: the baseline the prefix-aware
    router is measured against (benchmarks/scale_out.py)."""

    def initialize_state(self, **kwargs):
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        self._turn += 1
        return [[ordered[self._turn % len(ordered)]]] if ordered else []
