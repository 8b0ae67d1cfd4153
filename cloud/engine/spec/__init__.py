"""Speculative decoding: n-gram (prompt lookup) and draft-model proposals, verified losslessly by the target.

Modules: ``config`` (SpeculativeConfig), ``ngram`` and ``draft`` (proposers), ``rejection``
(the acceptance rule), ``policy`` (adaptive k, switch-off under load), ``speculator`` (the
per-step glue the engine calls), ``stats`` (metrics). Only the config is imported here, so
``apiary.cloud.engine.config`` can depend on it without an import cycle.
"""
from apiary.cloud.engine.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
