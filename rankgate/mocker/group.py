"""The DP group behind one endpoint: which rank serves a request, and finding it again.

Without a pinned rank the group balances like vLLM's internal DP load balancer: the rank with
the lowest ``waiting * 4 + running`` wins, lowest rank on ties. It never looks at the KV
cache, which is exactly what KV-aware routers are measured against.
"""

from __future__ import annotations

from rankgate.mocker.engine import EngineRequest, RankEngine
from rankgate.mocker.request import MockRequest
from rankgate.mocker.status import invalid_argument


class DpGroup:
    def __init__(self, engines: list[RankEngine]) -> None:
        self.engines = {engine.rank: engine for engine in engines}
        self._order = tuple(engines)
        self._ranks_text = "[" + ", ".join(str(e.rank) for e in engines) + "]"

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.engines)

    def pick(self, rank: int | None) -> RankEngine:
        if rank is not None:
            engine = self.engines.get(rank)
            if engine is None:
                raise invalid_argument(
                    f"engine-core error: data parallel rank {rank} is not connected to this "
                    f"frontend; connected ranks: {self._ranks_text}"
                )
            return engine
        best = self._order[0]
        best_score = best.load_score
        for engine in self._order[1:]:
            score = engine.load_score
            if score < best_score:
                best, best_score = engine, score
        return best

    def submit(self, req: MockRequest, rank: int | None) -> tuple[RankEngine, EngineRequest]:
        engine = self.pick(rank)
        return engine, engine.submit(req)

    def abort(self, request_ids: list[str]) -> int:
        aborted = 0
        for request_id in request_ids:
            for engine in self._order:
                if engine.abort(request_id):
                    aborted += 1
                    break
        return aborted

    @property
    def dead(self) -> bool:
        return any(engine.dead for engine in self._order)
