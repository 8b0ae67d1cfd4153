"""The edge agent: a solar-powered field device answering sensor events with a local INT4 model.

Modules, one concept each: ``settings`` (the ``[edge]`` config), ``model`` (llama.cpp
with a grammar and per-token logprobs), ``confidence`` (logprob/entropy quantiles),
``triage`` (which events need a model), ``policy`` (when to escalate, with reasons),
``energy`` (battery, solar and the token budget), ``store`` (SQLite inbox/outbox that
survives kill -9), ``agent`` (the process tying them to MQTT), ``cli``.
"""
