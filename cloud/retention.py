"""Retention: the running service prunes what is older than ``[cloud] retention_days``, periodically, in batches.

A background thread (not the MQTT or HTTP threads: a large first prune must not stall them) calls
:meth:`Store.prune` every ``retention_interval_s``, first soon after start. Each batch is its own short
transaction, so recording goes on between batches; replicas pruning the same PostgreSQL at once skip
each other's locked rows. Labelled events (training data) and unfinished escalation claims are never
pruned. 0 days keeps everything and starts no thread.
"""
from __future__ import annotations

import threading
import time

from apiary.shared.logs import get_logger

from apiary.cloud.store import Store

_log = get_logger("apiary.cloud.retention")

DAY_S = 86400.0


class Retention:
    def __init__(self, store: Store, days: float, *, interval_s: float = 3600.0, first_after_s: float = 30.0,
                 batch: int = 1000) -> None:
        self.store, self.days, self.interval_s, self.batch = store, days, interval_s, batch
        self.first_after_s = first_after_s
        self.pruned: dict[str, int] = {}  # totals since start, by table
        self.runs = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, now: float | None = None) -> dict[str, int]:
        """Prune everything recorded more than ``days`` before ``now``; how many rows of each table went."""
        removed = self.store.prune((now or time.time()) - self.days * DAY_S, batch=self.batch)
        for table, n in removed.items():
            self.pruned[table] = self.pruned.get(table, 0) + n
        self.runs += 1
        if any(removed.values()):
            _log.info("retention (%g days): pruned %s", self.days,
                      ", ".join(f"{n} {table}" for table, n in removed.items() if n))
        return removed

    def start(self) -> "Retention":
        if self.days > 0:
            self._thread = threading.Thread(target=self._loop, name="cloud-retention", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        wait = self.first_after_s
        while not self._stop.wait(wait):
            try:
                self.run_once()
            except Exception:  # a database hiccup must not end retention for the process's lifetime
                _log.exception("retention run failed; trying again in %g s", self.interval_s)
            wait = self.interval_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
